"""Admission decision time per step (Algorithm 1): pool of 10,000 samples, batch of 64 requests.

Target: under 50 µs per decision. The cost is a fixed part plus a part per run of equal-length
candidates and a small part per admitted sample (claiming it, holding its rows), so the run sweeps
the per-step fine-tuning cap (which sets how many samples one decision admits) and reports each.
A decision ends with the samples claimed from the pool and their rows reserved. Writes JSON
(default benchmarks/out/admission_latency.json).

    python benchmarks/admission_latency.py [--pool 10000] [--batch 64] [--steps 5000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from deltaserve.core import (
    AdmissionConfig,
    AdmissionScheduler,
    BufferLedger,
    HostLimits,
    SamplePool,
    SchedulingView,
    SLOConfig,
    StepShape,
    WaitingRequest,
    build_plan,
)
from deltaserve.core.latency_model import fit_from

TARGET_US = 50.0


def synthetic_time(s: StepShape) -> float:
    """A plausible step: 20 µs per token, quadratic attention, 5 ms launch overhead."""
    if s.is_decode_only:
        return 4e-4 * s.num_decode + 2e-7 * s.kv_tokens + 4e-3
    return (1e-8 * s.prefill_sq_tokens + 2e-5 * (s.num_prefill_tokens + s.num_decode)
            + 2.6e-5 * s.num_ft_tokens + 1e-7 * s.kv_tokens + 5e-3)


def run(cap: int, args, model, limits, lengths) -> dict:
    pool = SamplePool(lengths, num_epochs=None)
    ledger = BufferLedger(8192)
    sched = AdmissionScheduler(AdmissionConfig(max_ft_tokens_per_step=cap), SLOConfig(0.4, 0.12),
                               limits, model, pool, ledger)
    n_prefill = 4
    proposed = StepShape((350, 120, 60, 200), num_decode=args.batch - n_prefill,
                         kv_tokens=(args.batch - n_prefill) * 700)
    waiting = tuple(WaitingRequest(9.9 + 0.01 * i, 100 * i) for i in range(n_prefill))
    view = SchedulingView(proposed, now_s=10.0, waiting=waiting, oldest_decode_token_s=9.95)
    times, admitted = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        plan = sched.plan(view)
        times.append(time.perf_counter() - t0)
        admitted.append(len(plan.samples))
        ids = [s.sample_id for s in plan.samples]  # undo outside the timed region
        for sid in ids:
            ledger.free(sid)
        pool.release(ids)
    us = sorted(t * 1e6 for t in times[100:])  # drop warm-up
    return {
        "max_ft_tokens_per_step": cap,
        "admitted_samples": statistics.fmean(admitted),
        "admitted_tokens": plan.num_ft_tokens,
        "stop_reason": str(plan.skip),
        "mean_us": round(statistics.fmean(us), 2),
        "p50_us": round(us[len(us) // 2], 2),
        "p99_us": round(us[int(len(us) * 0.99)], 2),
        "meets_target": us[len(us) // 2] < TARGET_US,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool", type=int, default=10_000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5_000)
    ap.add_argument("--out", default="benchmarks/out/admission_latency.json")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    limits = HostLimits(max_tokens_per_step=8192, max_seqs_per_step=256, max_model_len=2048,
                        max_kv_tokens=1_000_000)
    model = fit_from([(p.shape, synthetic_time(p.shape)) for p in build_plan(limits)])
    # Tokenized instruction samples: log-normal lengths, median ~180 tokens (Alpaca plus a chat
    # template), clipped to [32, 1024].
    lengths = np.clip(rng.lognormal(np.log(180), 0.6, size=args.pool), 32, 1024).astype(int)
    rows = [run(cap, args, model, limits, lengths.tolist()) for cap in (256, 512, 1024, 2048)]
    print(f"pool {args.pool} samples, batch {args.batch} requests, target {TARGET_US:.0f} µs")
    print(f"{'cap':>6} {'samples':>8} {'p50 µs':>8} {'p99 µs':>8}  stop")
    for r in rows:
        print(f"{r['max_ft_tokens_per_step']:>6} {r['admitted_samples']:>8.1f} "
              f"{r['p50_us']:>8.1f} {r['p99_us']:>8.1f}  {r['stop_reason']}")
    result = {"pool_samples": args.pool, "batch_requests": args.batch, "target_us": TARGET_US,
              "scenarios": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
