"""``results.json`` of a simulated experiment: the CPU bench's keys (so its report renders it)
plus what only a simulation has: the GPU, the fleet, the memory budget, the oracle's noise and
the modelled parameters, the speed."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from deltaserve.hosts.sim.modelled import ModelledParams
from deltaserve.hosts.sim.oracle import PrefillChunk, SimBatch
from deltaserve.workloads.trace import Trace

if TYPE_CHECKING:
    from deltaserve.bench.sim.run import SimSetup


def results_doc(setup: SimSetup, trace: Trace, systems: dict[str, dict],
                standalone_tps: float, ablation: dict | None) -> dict:
    cfg, hw = setup.cfg, setup.hw
    pilot = systems.get("inference-only")
    budget = setup.limits.max_tokens_per_step
    full_step_s = hw.oracle.step_seconds(SimBatch(prefills=(PrefillChunk(budget),), tp=hw.tp))
    return {
        "trace": {"name": trace.name, "source": cfg.trace, "requests": len(trace),
                  "duration_s": trace.duration_s, "peak_rps": trace.peak_rate(),
                  "mean_rps": trace.mean_rate, "rate_factor": cfg.rate_scale,
                  "capacity_rps": None, "length_scale": 1.0,
                  "peak_prompt_tokens_per_s": peak_prompt_tokens_per_s(trace)},
        "slo": {"ttft_ms": cfg.ttft_slo_ms, "tpot_ms": cfg.tpot_slo_ms},
        "systems": systems,
        "standalone_training_tokens_per_s": standalone_tps,
        "inference_only_idle_fraction": pilot["idle_gpu_share"] if pilot else None,
        "heldout_accuracy": None,
        "calibration": [{"equation": q.equation.value, "mode": q.mode.value,
                         "points": q.num_points, "mape": q.mape, "r2": q.r2}
                        for q in setup.latency.quality()],
        "dataset": asdict(setup.data.report) | {"path": setup.data.path},
        "machine": {"host": "sim", "model": cfg.engine.model, "threads": 0,
                    "gpu": hw.name, "replicas": cfg.replicas, "tp": hw.tp,
                    "router": cfg.router.value, "kv_tokens_per_replica": hw.kv_tokens,
                    "prefill_tokens_per_s_per_replica": budget / full_step_s,
                    "memory": asdict(hw.memory) if hw.memory else None,
                    "noise_sigma": hw.noise_sigma,
                    "allreduce_ms": setup.allreduce_s(cfg.replicas) * 1e3,
                    "limits": asdict(setup.limits)},
        "modelled_params": asdict(hw.params),
        "modelled_param_sources": {name: {"unit": unit, "range": rng, "source": src}
                                   for name, _, unit, rng, src in ModelledParams.table()},
        "ablation": ablation,
        "config": asdict(cfg),
    }


def peak_prompt_tokens_per_s(trace: Trace, bin_s: float = 1.0) -> float:
    """The most prompt tokens that arrive in one ``bin_s`` window, per second."""
    bins: dict[int, int] = {}
    for r in trace.requests:
        k = int(r.arrival_s // bin_s)
        bins[k] = bins.get(k, 0) + r.prompt_tokens
    return max(bins.values(), default=0) / bin_s
