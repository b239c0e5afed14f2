"""Fine-tuning tokens/s on this machine: standalone PEFT vs DeltaServe's decoupled backward.

(a) PEFT + torch AdamW: forward and backward of each batch, the usual way.
(b) DeltaServe: the same batches, forwarded as a host would (activations captured), then trained
    by the backward process from the captured activations (layer-by-layer recompute).
Reports (b)/(a) for the backward alone (what co-serving adds beside the host's forward) and for
forward + backward. Writes JSON.

    python benchmarks/backward_throughput.py [--model smollm2] [--dataset PATH] [--batches 8]
        [--device cuda] [--no-peft]

``scripts/device_bench.sh`` calls :func:`backward_run` on a GPU (a random model, the generated
task's samples).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from deltaserve.bench.split_pool import base_model
from deltaserve.core import DataConfig, HostLimits, SLOConfig, build_plan, load_dataset
from deltaserve.core.data import TrainingSample
from deltaserve.core.latency_model import fit_from
from deltaserve.model import LlamaModel, LoRAConfig
from deltaserve.model.loading import load_tokenizer, load_weights, resolve_dtype, resolve_model
from deltaserve.train.capture import training_only_step
from deltaserve.train.config import BackwardConfig, CoServeConfig
from deltaserve.train.events import OptimizerStep
from deltaserve.train.facade import CoServer
from deltaserve.train.optim import OptimizerConfig

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "alpaca" / \
    "alpaca_5000.json"


def peft_run(path: Path, samples, batches, lora: LoRAConfig, opt_cfg: OptimizerConfig,
             dtype: str, device: str = "cpu") -> list:
    from peft import LoraConfig, get_peft_model

    hf = base_model(str(path), dtype, device, seed=0)
    pm = get_peft_model(hf, LoraConfig(r=lora.r, lora_alpha=lora.alpha,
                                       lora_dropout=lora.dropout,
                                       target_modules=list(lora.target_modules)))
    pm.train()
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay)
    times = []

    def tensor(data: list[list[int]]) -> torch.Tensor:
        return torch.tensor(data, device=device)

    for ids in batches:
        batch = [samples[i] for i in ids]
        n = max(s.num_tokens for s in batch)
        pad = [n - s.num_tokens for s in batch]
        t0 = time.perf_counter()
        rows = list(zip(batch, pad, strict=True))
        out = pm(input_ids=tensor([list(s.input_ids) + [0] * p for s, p in rows]),
                 attention_mask=tensor([[1] * s.num_tokens + [0] * p for s, p in rows]),
                 labels=tensor([list(s.labels) + [-100] * p for s, p in rows]))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, opt_cfg.max_grad_norm)
        opt.step()
        opt.zero_grad()
        float(out.loss)  # waits for the device
        times.append(time.perf_counter() - t0)
    return times


@dataclass(frozen=True)
class BackwardRun:
    """DeltaServe's training of ``batches`` backward batches: each batch's sample ids, tokens
    and backward wall seconds, the host-side forward (capture) seconds, and the backward jobs
    that failed (a failing backward commits nothing: the run then stops at its deadline)."""

    batches: list[tuple[int, ...]]
    tokens: list[int]
    backward_s: list[float]
    forward_s: list[float]
    forwarded_tokens: int
    failures: int

    @property
    def backward_tokens_per_s(self) -> float:
        return sum(self.tokens) / sum(self.backward_s) if self.backward_s else 0.0

    @property
    def forward_tokens_per_s(self) -> float:
        return self.forwarded_tokens / sum(self.forward_s) if self.forward_s else 0.0


def backward_run(model: LlamaModel, samples: Sequence[TrainingSample], lora: LoRAConfig,
                 opt_cfg: OptimizerConfig, num_batches: int, batch_tokens: int, threads: int,
                 save: str, base: str, deadline_s: float = 600.0) -> BackwardRun:
    """Forward ``samples`` as training-only host steps and let the backward process train
    ``num_batches`` batches (or stop at ``deadline_s``)."""
    limits = HostLimits(2048, 64, 2048, 1 << 20)
    # training-only steps face no SLO; any calibrated model prices them
    lm = fit_from([(p.shape, 1e-3 + 1e-5 * p.shape.num_tokens) for p in build_plan(limits)])
    config = CoServeConfig(SLOConfig(1.0, 1.0), lora=lora, optimizer=opt_cfg,
                           backward=BackwardConfig(batch_tokens=batch_tokens, threads=threads,
                                                   buffer_save=save))
    co = CoServer.for_model(config, limits, model, list(samples), base_model=base,
                            latency_model=lm)
    done: list[OptimizerStep] = []
    co.subscribe(lambda ev: done.append(ev) if isinstance(ev, OptimizerStep) else None)
    fwd_times = []
    end = time.monotonic() + deadline_s
    try:
        while len(done) < num_batches and time.monotonic() < end:
            t0 = time.perf_counter()
            if training_only_step(co, model, co.adapter) is not None:
                fwd_times.append(time.perf_counter() - t0)
            else:
                co.idle(timeout_s=0.1)
    finally:
        co.close(drain=False, checkpoint=False)
    stats = co.stats()
    kept = done[:num_batches]
    return BackwardRun([tuple(d.sample_ids) for d in kept], [d.num_tokens for d in kept],
                       [d.wall_s for d in kept], fwd_times, stats.ft_tokens_forwarded,
                       stats.backward_failures)


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
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--peft", action=argparse.BooleanOptionalAction, default=True,
                    help="also time PEFT + AdamW on the same batches")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    samples, report = load_dataset(DataConfig(args.dataset, max_tokens=512, skip_bad_rows=True),
                                   tok)
    print(f"dataset: {report.num_samples} samples, {report.num_tokens} tokens "
          f"({report.num_bad_rows} bad rows skipped, {report.num_dropped_overlength} too long)")
    dtype = resolve_dtype(args.dtype, args.device)
    model = LlamaModel(*load_weights(path, dtype, args.device))
    lora = LoRAConfig(dropout=0.0)
    opt_cfg = OptimizerConfig()
    pool_samples = samples[: 40 * args.batches]
    run = backward_run(model, pool_samples, lora, opt_cfg, args.batches, args.batch_tokens,
                       args.threads, args.save, str(path))
    total_tokens = sum(run.tokens)
    res = {
        "model": args.model, "device": args.device, "threads": args.threads,
        "dtype": str(dtype), "save": args.save, "batches": len(run.batches),
        "tokens": total_tokens, "backward_failures": run.failures,
        "deltaserve_backward_tokens_per_s": run.backward_tokens_per_s,
        "deltaserve_forward_capture_tokens_per_s": run.forward_tokens_per_s,
        "backward_step_s_median": statistics.median(run.backward_s) if run.backward_s else None,
    }
    res["deltaserve_fwd_plus_bwd_tokens_per_s"] = 1 / (
        1 / res["deltaserve_backward_tokens_per_s"]
        + 1 / res["deltaserve_forward_capture_tokens_per_s"]) if total_tokens else 0.0
    if args.peft and run.batches:
        peft = peft_run(path, pool_samples, run.batches, lora, opt_cfg, args.dtype,
                        args.device)
        res["peft_tokens_per_s"] = total_tokens / sum(peft)
        res["peft_step_s_median"] = statistics.median(peft)
        res["ratio_backward_vs_peft"] = res["deltaserve_backward_tokens_per_s"] / \
            res["peft_tokens_per_s"]
        res["ratio_fwd_plus_bwd_vs_peft"] = res["deltaserve_fwd_plus_bwd_tokens_per_s"] / \
            res["peft_tokens_per_s"]
    print(json.dumps(res, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
