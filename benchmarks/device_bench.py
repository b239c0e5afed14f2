"""The GPU measurement's Python stages, run by ``scripts/device_bench.sh`` (read it first).

    python benchmarks/device_bench.py engine   --model M --device D --out engine.json [--dry-run]
    python benchmarks/device_bench.py backward --model M --device D --out backward.json [--dry-run]
    python benchmarks/device_bench.py summarize --out-dir OUT

``engine``: the embedded engine's step time at the shapes the plain-PyTorch floor was measured
at on an H200 (``/work/shared/data/h200/README.md``), with and without CUDA graphs, beside that
floor. Each shape is a calibration probe (:func:`deltaserve.hosts.native.calibrate.probe_runs`):
real requests owning real KV blocks, their cached context not computed (attention costs the same
whatever the cached values are), one untimed warm-up run, then timed repeats through the
engine's real forward path. ``backward``: DeltaServe's backward (layer-wise recompute from the
captured activations) in FT tokens/s (:func:`backward_throughput.backward_run`). ``summarize``:
one Markdown page of every stage's numbers, the calibration's MAPE per equation and mode (from
the bench's saved latency model) and the bench's systems.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from backward_throughput import backward_run
from deltaserve.core import DataConfig, load_dataset, synthetic_task
from deltaserve.core.calibration import CalibrationProbe, ProbeKind
from deltaserve.core.shape import StepShape
from deltaserve.hosts.native import EngineConfig, LLMEngine
from deltaserve.hosts.native.calibrate import probe_runs
from deltaserve.model import LlamaModel, LoRAConfig
from deltaserve.model.loading import load_tokenizer, load_weights, resolve_dtype, resolve_model
from deltaserve.model.lora import AdapterWeights
from deltaserve.train.optim import OptimizerConfig
from device_bench_report import summarize

H200_README = "/work/shared/data/h200/README.md"


@dataclass(frozen=True)
class Shape:
    """A step to time: ``num_decode`` decodes of ``kv_per_decode`` cached tokens each, one
    prefill of ``prefill`` tokens, ``ft_tokens`` fine-tuning tokens riding along."""

    name: str
    num_decode: int = 0
    kv_per_decode: int = 0
    prefill: int = 0
    ft_tokens: int = 0

    def probe(self, repeats: int) -> CalibrationProbe:
        shape = StepShape(prefill_lens=(self.prefill,) if self.prefill else (),
                          num_decode=self.num_decode,
                          kv_tokens=self.num_decode * self.kv_per_decode,
                          ft_lens=(self.ft_tokens,) if self.ft_tokens else ())
        kind = ProbeKind.WITH_FT if self.ft_tokens else (
            ProbeKind.DECODE_GRID if self.num_decode else ProbeKind.PREFILL_SWEEP)
        return CalibrationProbe(kind, shape, repeats, kv_per_decode=self.kv_per_decode)

    @property
    def decode_only(self) -> bool:
        return self.num_decode > 0 and not self.prefill and not self.ft_tokens


# The H200's shapes (h200/README.md): decode B = 1/8/32/64 at L = 1024, a 2048-token prefill,
# and decode B = 32 at L = 1024 carrying 256 fine-tuning tokens.
SHAPES = (Shape("decode B=1 L=1024", 1, 1024), Shape("decode B=8 L=1024", 8, 1024),
          Shape("decode B=32 L=1024", 32, 1024), Shape("decode B=64 L=1024", 64, 1024),
          Shape("prefill 2048", prefill=2048),
          Shape("decode B=32 L=1024 + 256 FT", 32, 1024, ft_tokens=256))
DRY_SHAPES = (Shape("decode B=1 L=64", 1, 64), Shape("decode B=4 L=64", 4, 64),
              Shape("prefill 128", prefill=128), Shape("decode B=4 L=64 + 32 FT", 4, 64,
                                                       ft_tokens=32))


def decode_graph_floor_ms(batch: int, kv_per_decode: int) -> float:
    """The plain-PyTorch graph decode of the Llama-3-8B shape on the H200: the README's linear
    fit, 5.46 ms + 11.5 us per row + 53.4 ns per KV token (MAPE 1.6 % over its points)."""
    return 5.46 + 11.5e-3 * batch + 53.4e-6 * batch * kv_per_decode


# The floor at each shape and mode, in ms, from h200/README.md ("The plain-PyTorch floor"), and
# the project's engine at commit 2b6c3af ("The project's embedded engine on CUDA") for contrast.
H200_FLOOR_MS: dict[tuple[str, str], float] = {
    **{(s.name, "graph"): round(decode_graph_floor_ms(s.num_decode, s.kv_per_decode), 2)
       for s in SHAPES if s.decode_only},
    # eager decode is launch-bound: 15.3-17.5 ms flat up to B = 64; 16.7 measured at B=32 L=1024
    **{(s.name, "eager"): 16.7 for s in SHAPES if s.decode_only},
    ("prefill 2048", "eager"): 59.5,
    ("decode B=32 L=1024 + 256 FT", "eager"): 36.2,
}
H200_ENGINE_2B6C3AF_MS: dict[tuple[str, str], float] = {
    ("decode B=1 L=1024", "graph"): 8.2, ("decode B=8 L=1024", "graph"): 14.1,
    ("decode B=32 L=1024", "graph"): 31.4, ("decode B=64 L=1024", "graph"): 31.2,
    ("decode B=1 L=1024", "eager"): 42.0, ("decode B=8 L=1024", "eager"): 41.0,
    ("decode B=32 L=1024", "eager"): 81.0, ("decode B=64 L=1024", "eager"): 111.0,
}
H200_BACKWARD_FLOOR_TOKENS_PER_S = 1869.0  # plain-PyTorch LoRA backward, 1 x 256 tokens


def log(msg: str) -> None:
    print(f"[device-bench] {msg}", flush=True)


def _engine(model: str, device: str, shapes: tuple[Shape, ...]) -> LLMEngine:
    seqs = max(s.num_decode for s in shapes)
    step = max(s.prefill + s.num_decode + s.ft_tokens for s in shapes)
    kv = max(s.num_decode * (s.kv_per_decode + 1) + s.prefill for s in shapes)
    return LLMEngine(EngineConfig(model=model, device=device, max_num_seqs=seqs,
                                  max_num_batched_tokens=step, max_model_len=2 * step,
                                  kv_cache_tokens=max(kv, 2 * step) + 64 * 16))


def engine_table(model: str, device: str, shapes: tuple[Shape, ...], repeats: int
                 ) -> list[dict]:
    """Each shape's median and p90 step ms per mode (graph replay where the engine captured
    graphs and the shape is decode-only; eager always), beside the H200 floor."""
    t0 = time.monotonic()
    engine = _engine(model, device, shapes)
    log(f"engine on {device} ready in {time.monotonic() - t0:.1f} s "
        f"(graphs: {engine.runner.graphs is not None})")
    mc, weights = engine.model.config, engine.model.weights
    lora = LoRAConfig()
    adapter = AdapterWeights(mc, lora, device=weights.device).init_peft_(0)
    scratch = torch.empty(mc.num_layers, engine.limits.max_tokens_per_step, mc.hidden_size,
                          dtype=weights.dtype, device=weights.device)
    rng, graphs, rows = random.Random(0), engine.runner.graphs, []
    try:
        for s in shapes:
            for use_graphs in ((True, False) if graphs is not None and s.decode_only
                               else (False,)):
                engine.runner.graphs = graphs if use_graphs else None
                shape, times = probe_runs(engine, s.probe(repeats), lora, rng, adapter,
                                          scratch)
                rows.append(_row(s, shape.mode.value, times))
                log(f"{s.name} [{rows[-1]['mode']}]: median {rows[-1]['median_ms']} ms, "
                    f"floor {rows[-1]['h200_floor_ms']} ms")
    finally:
        engine.runner.graphs = graphs
        engine.close()
    return rows


def _row(s: Shape, mode: str, times: list[float]) -> dict:
    ms = sorted(t * 1e3 for t in times)
    floor = H200_FLOOR_MS.get((s.name, mode))
    median = statistics.median(ms)
    return {"shape": s.name, "mode": mode, "repeats": len(ms), "median_ms": round(median, 3),
            "p90_ms": round(ms[math.ceil(0.9 * len(ms)) - 1], 3), "h200_floor_ms": floor,
            "x_floor": round(median / floor, 2) if floor else None,
            "h200_engine_2b6c3af_ms": H200_ENGINE_2B6C3AF_MS.get((s.name, mode))}


def backward_stage(model: str, device: str, num_batches: int, deadline_s: float) -> dict:
    """DeltaServe's backward on the generated task's samples, in FT tokens/s."""
    path = resolve_model(model)
    tok = load_tokenizer(path)
    train, _ = synthetic_task.generate(40 * num_batches, 0, seed=0)
    with tempfile.TemporaryDirectory() as work:
        data = synthetic_task.write_jsonl(train, Path(work) / "train.jsonl")
        samples, _ = load_dataset(DataConfig(str(data), max_tokens=512), tok)
    model_obj = LlamaModel(*load_weights(path, resolve_dtype("auto", device), device))
    t0 = time.monotonic()
    run = backward_run(model_obj, samples, LoRAConfig(dropout=0.0), OptimizerConfig(),
                       num_batches, 256, torch.get_num_threads(), "residual", str(path),
                       deadline_s)
    res = {"model": model, "device": device, "batches": len(run.batches),
           "tokens": sum(run.tokens), "backward_failures": run.failures,
           "wall_s": round(time.monotonic() - t0, 2),
           "backward_tokens_per_s": round(run.backward_tokens_per_s, 1),
           "forward_capture_tokens_per_s": round(run.forward_tokens_per_s, 1),
           "backward_step_ms_median": round(1e3 * statistics.median(run.backward_s), 2)
           if run.backward_s else None,
           "h200_floor_tokens_per_s": H200_BACKWARD_FLOOR_TOKENS_PER_S}
    log(f"backward: {res['backward_tokens_per_s']} FT tokens/s over {res['batches']} batches "
        f"({res['backward_failures']} failed); H200 floor {H200_BACKWARD_FLOOR_TOKENS_PER_S}")
    return res


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=("engine", "backward", "summarize"))
    ap.add_argument("--model", default="random:llama-3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", help="the stage's JSON file (engine, backward)")
    ap.add_argument("--out-dir", help="summarize: the folder holding every stage's files")
    ap.add_argument("--bench-work", action="append", default=[],
                    help="summarize: a bench's work folder (its saved latency model)")
    ap.add_argument("--stages", help="summarize: the stages' table (name, exit, seconds)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes and repeats")
    ap.add_argument("--deadline-s", type=float, default=120.0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.stage == "summarize":
        summarize(Path(args.out_dir), [Path(p) for p in args.bench_work],
                  Path(args.stages) if args.stages else None)
        return 0
    t0 = time.monotonic()
    if args.stage == "engine":
        shapes, repeats = (DRY_SHAPES, 2) if args.dry_run else (SHAPES, 20)
        doc = {"floor_source": H200_README, "model": args.model, "device": args.device,
               "rows": engine_table(args.model, args.device, shapes, repeats)}
    else:
        doc = backward_stage(args.model, args.device, 2 if args.dry_run else 8,
                             args.deadline_s)
    doc["env"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                  "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda")
                  else None, "stage_wall_s": round(time.monotonic() - t0, 1)}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
