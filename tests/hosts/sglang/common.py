"""Shared by the SGLang host's engine tests: the LoRA config, prompts, co-serving helpers and
the transformers + PEFT reference."""

from __future__ import annotations

import threading
import time

import torch

from deltaserve.core.calibration import CalibrationConfig
from deltaserve.core.slo import SLOConfig
from deltaserve.model.lora import ALL_MODULES, AdapterWeights, LoRAConfig
from deltaserve.train.config import BackwardConfig, CoServeConfig

LORA = LoRAConfig(r=8, alpha=16, dropout=0.0, target_modules=ALL_MODULES)
PROMPTS = [[1, 504, 3575, 282, 4649, 314], [1, 1004, 2493, 416, 253, 655, 28],
           [1, 378, 3255, 282, 1015, 5264, 30, 378]]
SMALL_CAL = CalibrationConfig(decode_batches=(1, 2, 4, 8), decode_kv_lens=(16, 64, 128),
                              ft_totals=(32, 64, 128), repeats=2, split_total=128, max_split=4,
                              chunk_prefixes=(64, 300))  # 300: a prefix longer than a step


def coserve(host, latency, data, *, batch_tokens=64, slo=SLOConfig(30.0, 30.0), **kw):
    """A co-server on ``host``: one backward thread (see session.py), generous SLOs."""
    config = CoServeConfig(slo, lora=LORA,
                           backward=BackwardConfig(batch_tokens=batch_tokens, threads=1), **kw)
    return host.attach(config, dataset=data, latency_model=latency, progress=False)


def replay(host, prompts, params, gap_s=0.05):
    """Open loop: requests at fixed intervals while the host's loop runs in a thread."""
    stop = threading.Event()
    loop = threading.Thread(target=host.run_loop, args=(stop,), daemon=True)
    loop.start()
    ids = []
    try:
        for p in prompts:
            ids.append(host.add_request(p, params))
            time.sleep(gap_s)
        deadline = time.monotonic() + 600
        while host.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        loop.join()
    return [host.pop_finished(i) for i in ids]


def finish_epoch(host, co, timeout_s=600.0) -> None:
    """Step (training-only steps when idle) until the epoch is committed."""
    deadline = time.monotonic() + timeout_s
    while not co.book.progress().finished and time.monotonic() < deadline:
        if not host.step():
            co.idle(timeout_s=0.05)
            if not co.backward_busy:
                co.drain()
    assert co.book.progress().finished, co.book.progress()


def random_adapter(model_config, seed: int, scale: float = 0.05) -> AdapterWeights:
    """PEFT's A init and a random B: an adapter that changes the model's outputs."""
    ad = AdapterWeights(model_config, LORA).init_peft_(seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for _, _, _, b in ad.items():
            b.copy_(torch.randn(b.shape, generator=g) * scale)
    return ad


def peft_model(path, adapter: AdapterWeights):
    """A fresh transformers SmolLM2 (fp32) wrapped by PEFT with ``adapter``'s weights: the
    independent reference."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    cfg = adapter.config
    pm = get_peft_model(base, LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=0.0,
                                         target_modules=list(cfg.target_modules)))
    named = dict(pm.named_parameters())
    with torch.no_grad():
        for key, value in adapter.to_peft_state_dict().items():
            named[key.replace(".weight", ".default.weight")].copy_(value)
    return pm.eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(
            1, len(prompt), dtype=torch.long), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()
