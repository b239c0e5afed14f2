"""``deltaserve plan``: how much fine-tuning a fleet absorbs at an SLO, under a trace, on N
simulated GPUs of a kind: per fleet size, the FT tokens/s DeltaServe harvests and the SLO
attainment (with inference alone beside it, to tell the fleet's own shortfall from
co-serving's)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deltaserve.bench.sim.config import SimBenchConfig
from deltaserve.bench.sim.inputs import SimData, sim_trace
from deltaserve.bench.sim.run import prepare, run_systems, scored_json
from deltaserve.bench.sim.systems import sim_systems
from deltaserve.core.errors import require
from deltaserve.hosts.sim import standalone
from deltaserve.hosts.sim.catalogue import available_profiles, lookup_profile
from deltaserve.hosts.sim.config import SimHostConfig
from deltaserve.hosts.sim.fleet import Router


@dataclass(frozen=True)
class PlanConfig:
    """``trace``: a trace file (Azure, Mooncake or BurstGPT format), ``production`` (the Azure
    code trace of the shared data) or a synthetic name. ``replicas``: fleet sizes to plan
    (``1,2,4``). ``duration``: simulate the trace's first seconds only."""

    gpu: str = "a100"
    model: str = "llama-3-8b"
    trace: str = "production"
    slo_ttft_ms: float = 400.0
    slo_tpot_ms: float = 120.0
    replicas: tuple[int, ...] = (1, 2, 4)
    tp: int = 1
    router: Router = Router.ROUND_ROBIN
    duration_s: float | None = field(default=None, metadata={"flag": "duration"})
    rate_scale: float = 1.0
    dataset: str | None = None
    vidur_dir: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        require(bool(self.replicas) and min(self.replicas) >= 1, "replicas", self.replicas,
                "fleet sizes must be >= 1")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(self, name)
            require(math.isfinite(v) and v > 0, name, v, "must be > 0")
        require(self.trace in ("production", "burst-light", "burst-dense")
                or Path(self.trace).is_file(), "trace", self.trace,
                "a trace file, production, burst-light or burst-dense")


def bench_config(cfg: PlanConfig) -> SimBenchConfig:
    return SimBenchConfig(
        trace=cfg.trace, systems="inference-only,deltaserve", duration_s=cfg.duration_s,
        dataset=cfg.dataset, ttft_slo_ms=cfg.slo_ttft_ms, tpot_slo_ms=cfg.slo_tpot_ms,
        seed=cfg.seed, router=cfg.router, rate_scale=cfg.rate_scale, ablation=False,
        engine=SimHostConfig(model=cfg.model, gpu=cfg.gpu, tp=cfg.tp, vidur_dir=cfg.vidur_dir),
        progress=False)


def plan(cfg: PlanConfig, echo: Callable[[str], None] = print, data: SimData | None = None
         ) -> list[dict]:
    """One row per fleet size (printed as it is done). ``data``: tokenized samples (default:
    ``cfg.dataset``'s)."""
    lookup_profile(cfg.gpu, cfg.model)  # refuses a pair without profiles before any work
    echo(f"profiles: {', '.join(available_profiles())}; planning {cfg.gpu}/{cfg.model} "
         f"TP{cfg.tp}")
    setup = prepare(bench_config(cfg), data=data)
    trace = sim_trace(setup.cfg, setup.limits.max_model_len)
    echo(f"trace {trace.name}: {len(trace)} requests over {trace.duration_s:.0f} s, peak "
         f"{trace.peak_rate():.0f} req/s; SLO TTFT {cfg.slo_ttft_ms:.0f} ms, TPOT "
         f"{cfg.slo_tpot_ms:.0f} ms")
    rate = standalone.tokens_per_s(setup.hw, setup.data.samples,
                                   setup.cfg.backward.batch_tokens, seed=cfg.seed)
    echo(f"{'GPUs':>5} {'FT tok/s':>9} {'per GPU':>8} {'SLO (DeltaServe)':>17} "
         f"{'SLO (inference only)':>21} {'p99 TTFT ms':>12}")
    rows = []
    for n in cfg.replicas:
        scored = scored_json(setup, run_systems(setup, sim_systems(setup.cfg.systems), n,
                                                trace), rate)
        ds, inf = scored["deltaserve"], scored["inference-only"]
        row = {"replicas": n, "gpus": n * cfg.tp, "ft_tokens_per_s": ds["ft_tokens_per_s"],
               "slo_attainment": ds["slo_attainment"],
               "inference_only_slo_attainment": inf["slo_attainment"],
               "ttft_p99_ms": ds["ttft_p99_ms"]}
        rows.append(row)
        echo(f"{row['gpus']:>5} {row['ft_tokens_per_s']:>9.0f} "
             f"{row['ft_tokens_per_s'] / row['gpus']:>8.0f} "
             f"{100 * row['slo_attainment']:>16.1f}% "
             f"{100 * row['inference_only_slo_attainment']:>20.1f}% "
             f"{row['ttft_p99_ms'] or math.nan:>12.0f}")
    echo(f"standalone training on one {cfg.gpu}: {rate:.0f} tok/s")
    return rows
