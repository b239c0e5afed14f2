"""Shared by the vLLM host's engine tests."""

from __future__ import annotations

from deltaserve.core import CalibrationConfig
from deltaserve.core.data import IGNORE_INDEX, TrainingSample
from deltaserve.model import LoRAConfig

LORA = LoRAConfig(r=8, alpha=16, dropout=0.0)
SMALL_CAL = CalibrationConfig(min_prefill=16, split_total=64, max_split=2, decode_batches=(1, 4),
                              decode_kv_lens=(16, 64), ft_totals=(32, 64), repeats=1)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "The three primary colors are", "Once upon a time", "import numpy as np\n",
           "The largest planet in the solar system is", "Translate to French: good morning"]


def samples(tokenizer, n: int = 12) -> list[TrainingSample]:
    """Short instruction/response pairs, loss on the response only."""
    out = []
    for i in range(n):
        prompt = tokenizer(f"Question {i}: what is {i} plus {i + 1}? Answer:",
                           add_special_tokens=False)["input_ids"]
        answer = tokenizer(f" {2 * i + 1}. That is all.", add_special_tokens=False)["input_ids"]
        ids = tuple(prompt + answer)
        out.append(TrainingSample(i, ids, tuple([IGNORE_INDEX] * len(prompt) + answer)))
    return out
