"""A simulated run in the bench's own terms: its :class:`~deltaserve.bench.replay.ReplayResult`
and :class:`~deltaserve.bench.outcome.SystemRun`, scored by the bench's metrics.

Harvest is accounted in device-seconds (``metrics`` reads a "core" as a device): the inference-
only run's idle GPU-seconds, plus the GPUs split-pool reserves for its trainer, at the
standalone trainer's tokens per GPU-second.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deltaserve.bench import metrics as M
from deltaserve.bench.outcome import SystemRun
from deltaserve.bench.replay import ReplayResult, RequestRecord
from deltaserve.bench.systems import SystemSpec
from deltaserve.core.slo import SLOConfig
from deltaserve.hosts.sim.fleet import FleetRun


@dataclass(frozen=True)
class SimOutcome:
    """One system's simulated run: the bench's view (``run``), the fleet's (``fleet``), the
    GPUs it had (``gpus``: every replica's, ``reserved`` of them held by a standalone trainer;
    ``tp`` per replica)."""

    run: SystemRun
    fleet: FleetRun
    gpus: int
    reserved: int
    tp: int = 1


def replay_result(fleet: FleetRun) -> ReplayResult:
    """Requests as the bench records them: scheduled at their arrival, simulated time."""
    records = []
    for r in fleet.requests:
        rec = RequestRecord(r.index, r.arrival_s, r.prompt_tokens, r.output_tokens,
                            r.token_times_s, r.finished)
        records.append(rec)
    return ReplayResult(records, 0.0, fleet.end_s, fleet.end_s, fleet.steps, fleet.timed_out)


def system_run(spec: SystemSpec, fleet: FleetRun,
               commits: list[tuple[float, int, int]]) -> SystemRun:
    errors = [e for per in fleet.online_error for e in per]
    by_mode: dict[str, float] = {}
    for mode in {e.mode for e in errors}:
        mine = [e for e in errors if e.mode is mode]
        n = sum(e.num_steps for e in mine)
        by_mode[mode.value] = sum(e.mape * e.num_steps for e in mine) / n if n else 0.0
    return SystemRun(spec, replay_result(fleet), commits, by_mode)


def pooled_mape(run: SystemRun) -> float | None:
    """The latency model's online MAPE over every step (each mode weighted by its steps is not
    kept per run; the eager mode carries every co-served step, so it is the one reported)."""
    return run.mape_by_mode.get("eager")


@dataclass(frozen=True)
class HarvestBase:
    idle: M.IdleCapacity
    standalone_tokens_per_gpu_s: float


def harvest_base(pilot: SimOutcome, tp: int, standalone_tokens_per_s: float) -> HarvestBase:
    """The inference-only run's idle GPU-seconds; the standalone rate is of one replica's
    ``tp`` GPUs."""
    r = pilot.run.result
    idle = M.idle_capacity(r.steps, r.wall_s, pilot.gpus, tp)
    return HarvestBase(idle, M.tokens_per_core_s(standalone_tokens_per_s, tp))


def score(out: SimOutcome, slo: SLOConfig, base: HarvestBase | None) -> dict:
    """The bench's metrics of one system, with its harvest account, p95 latencies and the
    simulation's speed."""
    run, r = out.run, out.run.result
    busy = sum(s.seconds for s in r.steps) * out.tp
    inside = [c for c in run.ft_commits if r.start_s <= c[0] <= r.end_s]
    tokens = sum(c[1] for c in inside)
    account = None if base is None else M.harvest(tokens, base.idle,
                                                  base.standalone_tokens_per_gpu_s,
                                                  out.reserved, r.wall_s)
    metrics = M.compute(r.records, slo, r.wall_s, tokens, sum(c[2] for c in inside),
                        pooled_mape(run), account.ratio if account else None)
    return metrics.as_json() | {
        "harvest": account.as_json() if account else None,
        **tail_latencies(r.records),
        "gpus": out.gpus, "reserved_gpus": out.reserved, "busy_gpu_s": busy,
        "idle_gpu_share": 1.0 - busy / (out.gpus * r.wall_s) if r.wall_s else None,
        "barrier_wait_s": out.fleet.barrier_wait_s, "global_steps": out.fleet.global_steps,
        "simulated_s": out.fleet.end_s, "wall_s": out.fleet.wall_s,
        "simulated_s_per_wall_s": out.fleet.end_s / out.fleet.wall_s
        if out.fleet.wall_s else None,
        "events": out.fleet.events, "timed_out": out.fleet.timed_out,
    }


def tail_latencies(records: list[RequestRecord]) -> dict[str, float | None]:
    """p95 and mean of TTFT and end-to-end latency, ms (the ablations' measure)."""
    ttft = [r.ttft_s for r in records if r.ttft_s is not None]
    e2e = [r.e2e_s for r in records if r.e2e_s is not None]

    def pct(v: list[float], q: float) -> float | None:
        return float(np.percentile(v, q)) * 1e3 if v else None

    return {"ttft_p95_ms": pct(ttft, 95), "e2e_p95_ms": pct(e2e, 95),
            "ttft_mean_ms": float(np.mean(ttft)) * 1e3 if ttft else None,
            "e2e_mean_ms": float(np.mean(e2e)) * 1e3 if e2e else None}
