"""Does a paused backward slow the host's steps? The calibration probes with no backward, beside
a backward paused the way the grant used to pause it (polling a shared flag every 0.2 ms), and
beside one paused on today's grant (asleep on its wake-up pipe).

The latency model is calibrated with no backward process at all. While a co-serving job is in
flight on an ``exclusive`` grant, the backward process is paused through every host step; in the
committed SGLang runs those steps ran slower than their predictions. This runs the calibration
plan's probes through the embedded engine's forward (the host's threads on every core, as the
bench runs them), rotating the three modes round by round, and prints each mode's step time as
a ratio to the no-backward time per probe (the mean of a probe's runs: a preempted run counts).

    python benchmarks/grant_wait.py [--model smollm2] [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from multiprocessing.context import SpawnContext
from pathlib import Path

import torch
import torch.multiprocessing as mp

from deltaserve.core import build_plan
from deltaserve.hosts.native import EngineConfig, LLMEngine
from deltaserve.hosts.native.calibrate import probe_runs
from deltaserve.model.lora import AdapterWeights, LoRAConfig
from deltaserve.train.backward.grant import Grant

MODES = ("none", "poll", "pipe")
POLL_S = 2e-4  # the grant's poll interval before the wake-up pipe


def _poll_paused(flag) -> None:
    """The grant's wait before the pipe: check the shared byte, sleep 0.2 ms, again."""
    while not flag.value:
        time.sleep(POLL_S)


def _pipe_paused(grant: Grant) -> None:
    grant.wait()


def _start(ctx: SpawnContext, mode: str):
    """A paused backward of ``mode`` (the handle that releases it, its process), or none."""
    if mode == "none":
        return None, None
    if mode == "poll":
        flag = ctx.Value("b", 0, lock=False)
        proc = ctx.Process(target=_poll_paused, args=(flag,), daemon=True)
        release = flag
    else:
        grant = Grant(ctx)
        grant.clear()
        proc = ctx.Process(target=_pipe_paused, args=(grant,), daemon=True)
        release = grant
    proc.start()
    time.sleep(3.0)  # its interpreter has started and it is waiting
    return release, proc


def _stop(release, proc) -> None:
    if proc is None:
        return
    if isinstance(release, Grant):
        release.set()
    else:
        release.value = 1
    proc.join(30)


def _time_plan(engine, plan, lora, adapter, scratch, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [statistics.fmean(probe_runs(engine, p, lora, rng, adapter, scratch)[1])
            for p in plan]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="rotations of the three modes")
    ap.add_argument("--out", default="benchmarks/out/grant_wait.json")
    args = ap.parse_args()

    engine = LLMEngine(EngineConfig(model=args.model, num_threads=args.threads,
                                    max_num_batched_tokens=256, max_num_seqs=32,
                                    kv_cache_tokens=32768, max_model_len=1024))
    plan = build_plan(engine.limits)
    lora = LoRAConfig()
    mc = engine.model.config
    adapter = AdapterWeights(mc, lora, device=engine.model.weights.device).init_peft_(0)
    scratch = torch.empty(mc.num_layers, engine.limits.max_tokens_per_step, mc.hidden_size,
                          dtype=engine.model.weights.dtype)
    ctx = mp.get_context("spawn")
    times: dict[str, list[list[float]]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES[r % 3:] + MODES[:r % 3]:
            release, proc = _start(ctx, mode)
            try:
                times[mode].append(_time_plan(engine, plan, lora, adapter, scratch, seed=r))
            finally:
                _stop(release, proc)
            print(f"round {r + 1}/{args.rounds}: {mode} done", flush=True)

    summary = _summary(plan, times)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "summary": summary, "times_s": times},
                              indent=1))
    print(f"wrote {out}")


def _summary(plan, times: dict[str, list[list[float]]]) -> dict[str, dict[str, float]]:
    """Per mode and equation (probes over 20 ms): the median and mean over probes of the
    probe's median time over rounds, as a ratio to its time with no backward."""
    base = [statistics.median(x[i] for x in times["none"]) for i in range(len(plan))]
    summary: dict[str, dict[str, float]] = {}
    for mode in MODES[1:]:
        for eq in ("decode", "mixed"):
            ratios = [statistics.median(x[i] for x in times[mode]) / base[i]
                      for i, p in enumerate(plan)
                      if base[i] > 0.02 and p.shape.is_decode_only == (eq == "decode")]
            if ratios:
                key = f"{mode} {eq}"
                summary[key] = {"probes": len(ratios), "median": statistics.median(ratios),
                                "mean": statistics.fmean(ratios)}
                print(f"{key:12s} steps > 20 ms, ÷ no backward: median "
                      f"{summary[key]['median']:.3f}, mean {summary[key]['mean']:.3f} "
                      f"({len(ratios)} probes)")
    return summary


if __name__ == "__main__":
    main()
