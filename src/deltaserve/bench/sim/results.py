"""``results.json`` of a simulated experiment: the CPU bench's keys (so its report renders it)
plus what only a simulation has: the GPU, the fleet, the memory budget, the oracle's noise and
the modelled parameters, the speed."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from deltaserve.bench.results import FORMAT
from deltaserve.bench.score import HarvestBase, SystemScore, binding, comparisons
from deltaserve.bench.sim.score import SimScore
from deltaserve.bench.slo import SLOChoice
from deltaserve.bench.systems import PILOT
from deltaserve.hosts.sim.modelled import ModelledParams
from deltaserve.hosts.sim.oracle import PrefillChunk, SimBatch
from deltaserve.workloads.trace import Trace

if TYPE_CHECKING:
    from deltaserve.bench.sim.run import SimSetup


@dataclass(frozen=True)
class Scored:
    """Every system of one experiment scored at its SLO: ``scores`` in report order."""

    slo: SLOChoice
    base: HarvestBase
    scores: dict[str, SimScore]
    standalone_tokens_per_s: float

    @property
    def bench_scores(self) -> dict[str, SystemScore]:
        return {n: s.score for n, s in self.scores.items()}


def results_doc(setup: SimSetup, trace: Trace, scored: Scored, ablation: dict | None) -> dict:
    """The CPU bench's keys (its tables and report render it) and the simulation's own."""
    cfg, hw = setup.cfg, setup.hw
    pilot = scored.scores.get(PILOT)
    bench = scored.bench_scores
    return {
        "format": FORMAT,
        # as the real bench states it: every system's fine-tuning counted in this one window
        # (simulated seconds: the trace and one drain); each system ran ``repeats`` times
        "window_s": scored.base.window_s,
        "drain_s": cfg.drain_s,
        "repeats": cfg.repeats,
        "trace": trace_doc(trace, cfg.trace, cfg.rate_scale),
        "slo": asdict(scored.slo) | {"text": scored.slo.describe()},
        "slo_binding": binding(bench).as_json(),
        "systems": {n: s.as_json() for n, s in scored.scores.items()},
        "comparisons": [c.as_json() for c in comparisons(bench)],
        "sweep": [],
        "harvest": scored.base.as_json(),
        "standalone_training_tokens_per_s": scored.standalone_tokens_per_s,
        "inference_only_idle_fraction": pilot.as_json()["idle_gpu_share"] if pilot else None,
        "heldout_accuracy": None,
        "calibration": [{"equation": q.equation.value, "mode": q.mode.value,
                         "points": q.num_points, "mape": q.mape, "r2": q.r2}
                        for q in setup.latency.quality()],
        "dataset": asdict(setup.data.report) | {"path": setup.data.path},
        "machine": machine_doc(setup),
        "modelled_params": asdict(hw.params),
        "modelled_param_sources": {name: {"unit": unit, "range": rng, "source": src}
                                   for name, _, unit, rng, src in ModelledParams.table()},
        "ablation": ablation,
        # the simulated host holds no step out and scores the latency model on every step
        "config": asdict(cfg) | {"latency_holdout_every": 0, "latency_error_min_ms": 0.0},
    }


def trace_doc(trace: Trace, source: str, rate_factor: float) -> dict:
    return {"name": trace.name, "source": source, "requests": len(trace),
            "duration_s": trace.duration_s, "peak_rps": trace.peak_rate(),
            "mean_rps": trace.mean_rate, "rate_factor": rate_factor, "capacity_rps": None,
            "length_scale": 1.0, "peak_prompt_tokens_per_s": peak_prompt_tokens_per_s(trace)}


def machine_doc(setup: SimSetup) -> dict:
    cfg, hw = setup.cfg, setup.hw
    budget = setup.limits.max_tokens_per_step
    full_step_s = hw.oracle.step_seconds(SimBatch(prefills=(PrefillChunk(budget),), tp=hw.tp))
    return {"host": "sim", "model": cfg.engine.model, "threads": 0, "cpu_count": os.cpu_count(),
            "cuda": False, "gpu": hw.name, "replicas": cfg.replicas, "tp": hw.tp,
            "router": cfg.router.value, "kv_tokens_per_replica": hw.kv_tokens,
            "prefill_tokens_per_s_per_replica": budget / full_step_s,
            "memory": asdict(hw.memory) if hw.memory else None,
            "noise_sigma": hw.noise_sigma,
            "allreduce_ms": setup.allreduce_s(cfg.replicas) * 1e3,
            "limits": asdict(setup.limits)}


def peak_prompt_tokens_per_s(trace: Trace, bin_s: float = 1.0) -> float:
    """The most prompt tokens that arrive in one ``bin_s`` window, per second."""
    bins: dict[int, int] = {}
    for r in trace.requests:
        k = int(r.arrival_s // bin_s)
        bins[k] = bins.get(k, 0) + r.prompt_tokens
    return max(bins.values(), default=0) / bin_s
