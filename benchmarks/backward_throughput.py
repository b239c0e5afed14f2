"""Fine-tuning tokens/s on this machine: standalone PEFT vs DeltaServe's decoupled backward.

(a) PEFT + torch AdamW: forward and backward of each batch, the usual way.
(b) DeltaServe: the same batches, forwarded as a host would (activations captured), then trained
    by the backward process from the captured activations (layer-by-layer recompute).
Reports (b)/(a) for the backward alone (what co-serving adds beside the host's forward) and for
forward + backward. Writes JSON.

    python benchmarks/backward_throughput.py [--model smollm2] [--dataset PATH] [--batches 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from deltaserve.core import DataConfig, HostLimits, SLOConfig, build_plan, load_dataset
from deltaserve.core.latency_model import fit_from
from deltaserve.model import LlamaModel, LoRAConfig
from deltaserve.model.loading import load_tokenizer, load_weights, resolve_dtype, resolve_model
from deltaserve.train.capture import training_only_step
from deltaserve.train.config import BackwardConfig, CoServeConfig
from deltaserve.train.coserver import CoServer
from deltaserve.train.events import OptimizerStep
from deltaserve.train.optim import OptimizerConfig

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "alpaca" / \
    "alpaca_5000.json"


def peft_run(path: Path, samples, batches, lora: LoRAConfig, opt_cfg: OptimizerConfig,
             dtype: torch.dtype) -> list:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    pm = get_peft_model(hf, LoraConfig(r=lora.r, lora_alpha=lora.alpha,
                                       lora_dropout=lora.dropout,
                                       target_modules=list(lora.target_modules)))
    pm.train()
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay)
    times = []
    for ids in batches:
        batch = [samples[i] for i in ids]
        n = max(s.num_tokens for s in batch)
        pad = [n - s.num_tokens for s in batch]
        t0 = time.perf_counter()
        rows = list(zip(batch, pad, strict=True))
        out = pm(input_ids=torch.tensor([list(s.input_ids) + [0] * p for s, p in rows]),
                 attention_mask=torch.tensor([[1] * s.num_tokens + [0] * p for s, p in rows]),
                 labels=torch.tensor([list(s.labels) + [-100] * p for s, p in rows]))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, opt_cfg.max_grad_norm)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dataset", default=str(DEFAULT_DATA))
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    ap.add_argument("--save", default="residual", help="buffer: residual or residual+mlp")
    ap.add_argument("--out", default="benchmarks/out/backward_throughput.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    samples, report = load_dataset(DataConfig(args.dataset, max_tokens=512, skip_bad_rows=True),
                                   tok)
    print(f"dataset: {report.num_samples} samples, {report.num_tokens} tokens "
          f"({report.num_bad_rows} bad rows skipped, {report.num_dropped_overlength} too long)")
    dtype = resolve_dtype(args.dtype)
    model = LlamaModel(*load_weights(path, dtype))
    lora = LoRAConfig(dropout=0.0)
    opt_cfg = OptimizerConfig()
    limits = HostLimits(2048, 64, 2048, 1 << 20)
    # training-only steps face no SLO; any calibrated model prices them
    lm = fit_from([(p.shape, 1e-3 + 1e-5 * p.shape.num_tokens) for p in build_plan(limits)])
    pool_samples = samples[: 40 * args.batches]
    co = CoServer(CoServeConfig(SLOConfig(1.0, 1.0), lora=lora, optimizer=opt_cfg,
                                backward=BackwardConfig(batch_tokens=args.batch_tokens,
                                                        threads=args.threads,
                                                        buffer_save=args.save)),
                  limits, model, pool_samples, base_model=str(path), latency_model=lm)
    done: list[OptimizerStep] = []
    co.subscribe(lambda ev: done.append(ev) if isinstance(ev, OptimizerStep) else None)
    fwd_times = []
    try:
        while len(done) < args.batches:
            t0 = time.perf_counter()
            if training_only_step(co, model, co.adapter) is not None:
                fwd_times.append(time.perf_counter() - t0)
            else:
                co.idle(timeout_s=0.1)
    finally:
        co.close(drain=False, checkpoint=False)
    batches = [d.sample_ids for d in done[: args.batches]]
    tokens = [d.num_tokens for d in done[: args.batches]]
    bwd = [d.wall_s for d in done[: args.batches]]
    peft = peft_run(path, pool_samples, batches, lora, opt_cfg, dtype)
    total_tokens = sum(tokens)
    res = {
        "model": args.model, "threads": args.threads, "dtype": str(dtype), "save": args.save,
        "batches": len(batches),
        "tokens": total_tokens,
        "peft_tokens_per_s": total_tokens / sum(peft),
        "deltaserve_backward_tokens_per_s": total_tokens / sum(bwd),
        "deltaserve_forward_capture_tokens_per_s":
            co.stats().ft_tokens_forwarded / sum(fwd_times),
    }
    res["deltaserve_fwd_plus_bwd_tokens_per_s"] = 1 / (
        1 / res["deltaserve_backward_tokens_per_s"]
        + 1 / res["deltaserve_forward_capture_tokens_per_s"])
    res["ratio_backward_vs_peft"] = res["deltaserve_backward_tokens_per_s"] / \
        res["peft_tokens_per_s"]
    res["ratio_fwd_plus_bwd_vs_peft"] = res["deltaserve_fwd_plus_bwd_tokens_per_s"] / \
        res["peft_tokens_per_s"]
    res["peft_step_s_median"] = statistics.median(peft)
    res["backward_step_s_median"] = statistics.median(bwd)
    print(json.dumps(res, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
