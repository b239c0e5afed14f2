"""Profile the embedded engine on this machine for the simulator's validation: its real steps
timed through its own forward path (the calibration plan's probes and random mixed shapes over
the region the CPU bench's trace reaches), real backward jobs of the co-server's backward
process, and the split-pool trainer's standalone throughput. Writes the profile that
:mod:`deltaserve.hosts.sim.measured` builds an oracle from.

    python -m deltaserve.bench.sim.cpu_profile --out cpu_profile.json [--threads 1 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
from dataclasses import replace

import torch

from deltaserve.bench.split_pool import standalone_tokens_per_s
from deltaserve.core import synthetic_task
from deltaserve.core.calibration import CalibrationConfig, CalibrationProbe, ProbeKind, build_plan
from deltaserve.core.data import DataConfig, TrainingSample, load_dataset
from deltaserve.core.latency_model import fit_from
from deltaserve.core.shape import StepShape
from deltaserve.core.slo import SLOConfig
from deltaserve.hosts.native.calibrate import probe_runs
from deltaserve.hosts.native.config import EngineConfig
from deltaserve.hosts.native.engine import LLMEngine
from deltaserve.hosts.sim.measured import FORMAT
from deltaserve.model.loading import load_tokenizer, resolve_model
from deltaserve.model.lora import AdapterWeights, LoRAConfig
from deltaserve.train.capture import training_only_step
from deltaserve.train.config import BackwardConfig, CoServeConfig, GrantPolicy
from deltaserve.train.events import OptimizerStep
from deltaserve.train.facade import CoServer
from deltaserve.train.optim import OptimizerConfig

# the CPU bench's region: prompts up to 512 + 64 output tokens, 256 tokens and 32 sequences a step
CPU_PLAN = CalibrationConfig(decode_kv_lens=(32, 128, 384, 576),
                             decode_batches=(1, 2, 4, 8, 16, 24, 32), ft_totals=(32, 64, 128, 256))


def random_probes(n: int, budget: int, max_seqs: int, seed: int) -> list[CalibrationProbe]:
    """Mixed steps: decodes over one context length, prefill chunks behind one prefix, training
    samples; within the step's token and sequence limits."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        decodes = rng.choice((0, 0, 1, 2, 4, 8, 12, 16, 24))
        ft = [rng.randint(16, 128) for _ in range(rng.choice((0, 0, 1, 2, 3)))]
        room = budget - decodes - sum(ft)
        chunks = rng.choice((0, 1, 1, 2, 3))
        prefill = [rng.randint(8, max(8, room // max(1, chunks))) for _ in range(chunks)]
        if (room < sum(prefill) or decodes + chunks + len(ft) > max_seqs
                or not (decodes or prefill or ft)):
            continue
        shape = StepShape(tuple(prefill), decodes, 0, tuple(ft))
        out.append(CalibrationProbe(ProbeKind.MIXED, shape, 3,
                                    kv_per_decode=rng.choice((32, 96, 192, 384, 576)),
                                    prefix_len=rng.choice((0, 0, 64, 256))))
    return out


def time_probe(engine: LLMEngine, probe: CalibrationProbe, lora: LoRAConfig,
               rng: random.Random, adapter: AdapterWeights, scratch: torch.Tensor
               ) -> tuple[float, float]:
    """Median seconds and log-space spread of a probe's repeats (after one warm-up run)."""
    _, times = probe_runs(engine, probe, lora, rng, adapter, scratch)
    return statistics.median(times), statistics.pstdev([math.log(t) for t in times])


def profile_steps(engine: LLMEngine, lora: LoRAConfig, seed: int, n_random: int) -> list[dict]:
    limits = engine.limits
    probes = list(build_plan(limits, CPU_PLAN)) + random_probes(
        n_random, limits.max_tokens_per_step, limits.max_seqs_per_step, seed)
    mc = engine.model.config
    adapter = AdapterWeights(mc, lora, device=engine.model.weights.device).init_peft_(seed)
    scratch = torch.empty(mc.num_layers, limits.max_tokens_per_step, mc.hidden_size,
                          dtype=engine.model.weights.dtype)
    rng, out = random.Random(seed), []
    for i, probe in enumerate(probes):
        seconds, spread = time_probe(engine, probe, lora, rng, adapter, scratch)
        s = probe.shape
        out.append({"prefill": list(s.prefill_lens), "prefix": probe.prefix_len,
                    "decodes": s.num_decode, "kv": probe.kv_per_decode, "ft": list(s.ft_lens),
                    "seconds": seconds, "log_spread": spread})
        if i % 25 == 0:
            print(f"[cpu-profile] step {i}/{len(probes)}: {seconds * 1e3:.1f} ms", flush=True)
    return out


def profile_backward(engine: LLMEngine, samples: list[TrainingSample], lora: LoRAConfig,
                     threads: int, jobs: int) -> list[dict]:
    """Real backward jobs of the co-server's backward process on ``threads`` threads (its own
    cores, as the CPU bench's partition), batches of 128 to 384 tokens."""
    limits = engine.limits
    lm = fit_from([(p.shape, 1e-3 + 1e-5 * p.shape.num_tokens) for p in build_plan(limits)])
    out = []
    for batch in (128, 256, 384):
        cfg = CoServeConfig(SLOConfig(1.0, 1.0), lora=lora, optimizer=OptimizerConfig(),
                            backward=BackwardConfig(batch_tokens=batch, threads=threads,
                                                    grant_policy=GrantPolicy.PARTITION))
        co = CoServer.for_model(cfg, limits, engine.model, samples,
                                base_model=engine.model_path, latency_model=lm)
        done: list[OptimizerStep] = []
        co.subscribe(lambda ev, d=done: d.append(ev) if isinstance(ev, OptimizerStep) else None)
        try:
            while len(done) < jobs:
                if training_only_step(co, engine.model, co.adapter) is None:
                    co.idle(timeout_s=0.05)
        finally:
            co.close(drain=False, checkpoint=False)
        out += [{"lens": [samples[i].num_tokens for i in d.sample_ids], "seconds": d.wall_s}
                for d in done[1:jobs]]  # the first pays one-time costs
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="cpu_profile.json")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--random-probes", type=int, default=120)
    ap.add_argument("--backward-jobs", type=int, default=5)
    ap.add_argument("--standalone-seconds", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = resolve_model("smollm2")
    tok = load_tokenizer(path)
    train, _ = synthetic_task.generate(2000, 0, args.seed)
    data = synthetic_task.write_jsonl(train, "/tmp/deltaserve-cpu-profile/train.jsonl")
    samples, _ = load_dataset(DataConfig(str(data), max_tokens=256), tok)
    lora = LoRAConfig()
    doc = {"format": FORMAT, "model": "smollm2", "threads": {},
           "machine": {"cpu_count": os.cpu_count(), "load_average_start": os.getloadavg()}}
    for t in args.threads:
        engine = LLMEngine(replace(EngineConfig(), num_threads=t, seed=args.seed))
        entry = {"steps": profile_steps(engine, lora, args.seed, args.random_probes)}
        entry["backward"] = profile_backward(engine, samples, lora, t, args.backward_jobs)
        entry["standalone_tokens_per_s"] = standalone_tokens_per_s(
            str(path), samples, lora, OptimizerConfig(), 256, t, args.standalone_seconds)
        engine.close()
        doc["threads"][str(t)] = entry
        print(f"[cpu-profile] {t} thread(s): {len(entry['steps'])} steps, "
              f"{len(entry['backward'])} backward jobs, standalone "
              f"{entry['standalone_tokens_per_s']:.0f} tok/s", flush=True)
    doc["machine"]["load_average_end"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
