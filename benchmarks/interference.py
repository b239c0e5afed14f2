"""Does training on another core slow the host's steps? Same probes, other core idle vs busy.

On a CPU the bench partitions the cores: the host on some, the backward on the rest. The latency
model is calibrated with the other cores idle and does not know when the backward computes. This
runs the calibration plan's probes through the embedded engine (its real forward path) twice,
alternating per probe: once with the other cores idle, once while a LoRA trainer (PEFT + AdamW,
the split-pool trainer: the same kind of memory traffic as the backward) runs on them. Prints the
busy/idle step-time ratio per equation (decode-only, prefill-carrying) and writes JSON.

    python benchmarks/interference.py [--model smollm2] [--host-threads 1] [--trainer-threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from deltaserve.core import DataConfig, build_plan, load_dataset, synthetic_task
from deltaserve.hosts.native import EngineConfig, LLMEngine
from deltaserve.hosts.native.calibrate import time_probe
from deltaserve.model.loading import load_tokenizer, resolve_model
from deltaserve.model.lora import AdapterWeights, LoRAConfig
from deltaserve.train.optim import OptimizerConfig


def _time_plan(engine, plan, lora, adapter, scratch, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [time_probe(engine, p, lora, rng, adapter, scratch)[1] for p in plan]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--host-threads", type=int, default=1)
    ap.add_argument("--trainer-threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="idle/busy alternations")
    ap.add_argument("--out", default="benchmarks/out/interference.json")
    args = ap.parse_args()

    from deltaserve.bench.split_pool import StandaloneTrainer  # spawns: keep main importable

    path = resolve_model(args.model)
    engine = LLMEngine(EngineConfig(model=args.model, num_threads=args.host_threads,
                                    max_num_batched_tokens=256, max_num_seqs=32,
                                    kv_cache_tokens=32768, max_model_len=1024))
    plan = build_plan(engine.limits)
    lora = LoRAConfig()
    mc = engine.model.config
    adapter = AdapterWeights(mc, lora, device=engine.model.weights.device).init_peft_(0)
    scratch = torch.empty(mc.num_layers, engine.limits.max_tokens_per_step, mc.hidden_size,
                          dtype=engine.model.weights.dtype)

    tmp = Path(args.out).parent / "interference_data.jsonl"
    train, _ = synthetic_task.generate(400, 1, 0)
    synthetic_task.write_jsonl(train, tmp)
    samples, _ = load_dataset(DataConfig(str(tmp), max_tokens=512), load_tokenizer(path))

    idle: list[list[float]] = []
    busy: list[list[float]] = []
    for r in range(args.rounds):
        idle.append(_time_plan(engine, plan, lora, adapter, scratch, seed=r))
        trainer = StandaloneTrainer(str(path), samples, lora, OptimizerConfig(), 256,
                                    threads=args.trainer_threads, dtype="auto")
        trainer.start()
        while not trainer.collect():  # past its first step: it is computing steadily
            time.sleep(0.05)
        busy.append(_time_plan(engine, plan, lora, adapter, scratch, seed=r))
        steps = trainer.stop()
        print(f"round {r}: trainer ran {len(steps)} steps beside the probes")

    rows = []
    for i, p in enumerate(plan):
        t_idle = statistics.median(x[i] for x in idle)
        t_busy = statistics.median(x[i] for x in busy)
        rows.append({"equation": "decode" if p.shape.is_decode_only else "mixed",
                     "num_tokens": p.shape.num_tokens, "num_ft_tokens": p.shape.num_ft_tokens,
                     "idle_s": t_idle, "busy_s": t_busy, "ratio": t_busy / t_idle})
    summary = {}
    for eq in ("decode", "mixed"):
        ratios = sorted(r["ratio"] for r in rows if r["equation"] == eq and r["idle_s"] > 0.02)
        if ratios:
            summary[eq] = {"probes": len(ratios), "median": statistics.median(ratios),
                           "p90": ratios[int(0.9 * (len(ratios) - 1))], "max": ratios[-1]}
            print(f"{eq:6s} steps > 20 ms: busy/idle median {summary[eq]['median']:.3f}, "
                  f"p90 {summary[eq]['p90']:.3f}, max {summary[eq]['max']:.3f} "
                  f"({len(ratios)} probes)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "summary": summary, "probes": rows},
                              indent=1))
    tmp.unlink()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
