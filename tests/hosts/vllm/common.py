"""Shared by the vLLM host's engine tests."""

from __future__ import annotations

import torch

from deltaserve.core import CalibrationConfig, SLOConfig
from deltaserve.core.admission import AdmissionConfig
from deltaserve.core.data import IGNORE_INDEX, TrainingSample
from deltaserve.model import AdapterWeights, LoRAConfig
from deltaserve.model.loading import resolve_model
from deltaserve.model.lora import peft_key
from deltaserve.train.messages import JobSample
from deltaserve.train.recompute import layerwise_backward

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


def record_plans(co) -> list:
    """Every admission plan ``co`` makes from now on, appended to the returned list."""
    plans = []
    plan = co.plan

    def record(view):
        p = plan(view)
        plans.append(p)
        return p

    co.plan = record
    return plans


def vllm_captured_grads(host, latency, data: list[TrainingSample], seed: int = 3
                        ) -> tuple[torch.Tensor, AdapterWeights]:
    """LoRA gradients of ``data`` by the backward's recompute from activations captured inside
    vLLM (one training-only step), at a random non-trivial adapter (every gradient path live);
    and that adapter."""
    from deltaserve.hosts.vllm import attach, detach

    co = attach(host, dataset=data, slo=SLOConfig(30.0, 30.0), latency_model=latency,
                progress=False, lora=LORA, interrupt=False, backward_batch_tokens=4096,
                admission=AdmissionConfig(max_ft_tokens_per_step=256))
    try:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            co.adapter.flat.copy_(torch.randn(co.adapter.numel, generator=g) * 0.02)
        host.link.publisher.publish(co.adapter)
        weights = AdapterWeights(co.model.config, co.config.lora, co.adapter.flat.clone())
        plans = record_plans(co)
        assert host.step()  # an idle engine: one training-only step captures every sample
        admitted = [s for p in plans for s in p.samples]
        assert sorted(s.sample_id for s in admitted) == [s.sample_id for s in data]
        jobs = [JobSample(s.sample_id, s.rows.start, data[s.sample_id].labels, 0)
                for s in admitted]
        trainable = weights.clone(requires_grad=True)
        layerwise_backward(co.model, trainable, co.buffer, jobs, 0.0)
        return trainable.gather_grad_().float(), weights
    finally:
        detach(host, drain=False, checkpoint=False)


def peft_grads(weights: AdapterWeights, data: list[TrainingSample], dtype: torch.dtype
               ) -> torch.Tensor:
    """The same gradients from transformers + peft (the independent reference), with smollm2
    loaded in ``dtype``; laid out like :meth:`AdapterWeights.gather_grad_`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2"), dtype=dtype)
    pm = get_peft_model(hf, LoraConfig(r=LORA.r, lora_alpha=LORA.alpha, lora_dropout=0.0,
                                       target_modules=list(LORA.target_modules)))
    named = dict(pm.named_parameters())
    with torch.no_grad():
        for key, value in weights.to_peft_state_dict().items():
            named[key.replace(".weight", ".default.weight")].copy_(value)
    n = max(s.num_tokens for s in data)
    pad = lambda seq, v: list(seq) + [v] * (n - len(seq))  # noqa: E731
    batch = dict(input_ids=torch.tensor([pad(s.input_ids, 0) for s in data]),
                 attention_mask=torch.tensor([pad([1] * s.num_tokens, 0) for s in data]),
                 labels=torch.tensor([pad(s.labels, IGNORE_INDEX) for s in data]))
    pm(**batch).loss.backward()
    want = torch.zeros(weights.numel)
    ref = AdapterWeights(weights.model_config, weights.config, want)
    for layer, module, a, b in ref.items():
        for which, dst in (("A", a), ("B", b)):
            key = peft_key(layer, module, which).replace(".weight", ".default.weight")
            dst.copy_(named[key].grad.float())
    return want


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())
