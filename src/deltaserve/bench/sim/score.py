"""A simulated run in the bench's own terms: a :class:`~deltaserve.bench.outcome.SystemRun`
(requests, commits, latency-model error, hardware share) scored by the bench's own
:func:`~deltaserve.bench.score.score_run`, plus what only a simulation has (its GPUs' busy time,
the data-parallel barrier, its speed).

Every system is scored over one window, as on a real host: the trace's duration plus
``drain_s``, in simulated seconds from the replay's start (0). Fine-tuning counts the tokens
committed in it; the harvest is accounted in GPU-seconds over it (the bench's "cores" read as
GPUs): the inference-only run's idle GPU-seconds in the window (each of its steps ran on one
replica's ``tp`` GPUs; its drained tail is idle), plus the GPUs split-pool reserves for its
trainer for the whole window, at the standalone trainer's tokens per GPU-second (measured on
one replica's ``tp`` GPUs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from deltaserve.bench import metrics as M
from deltaserve.bench.latency_holdout import ModeError
from deltaserve.bench.outcome import Commit, HardwareShare, SystemRun
from deltaserve.bench.replay import ReplayResult, RequestRecord
from deltaserve.bench.score import HarvestBase, SystemScore, score_run
from deltaserve.bench.systems import SystemSpec
from deltaserve.core.shape import ExecMode
from deltaserve.core.slo import SLOConfig
from deltaserve.hosts.sim.fleet import FleetRun


@dataclass(frozen=True)
class SimOutcome:
    """One system's simulated run: the bench's view (``run``) and the fleet's (``fleet``);
    ``tp``: GPUs per replica; ``window_s``: the scoring window it was replayed for (simulated
    seconds from the replay's start)."""

    run: SystemRun
    fleet: FleetRun
    tp: int
    window_s: float


def replay_result(fleet: FleetRun) -> ReplayResult:
    """Requests as the bench records them: scheduled at their arrival, simulated time."""
    records = [RequestRecord(r.index, r.arrival_s, r.prompt_tokens, r.output_tokens,
                             r.token_times_s, r.finished) for r in fleet.requests]
    return ReplayResult(records, 0.0, fleet.end_s, fleet.end_s, fleet.steps, fleet.timed_out)


def latency_errors(fleet: FleetRun) -> tuple[ModeError, ...]:
    """Every replica's online error pooled per execution mode (step-weighted); the simulated
    host holds no step out, so there is no held-out error."""
    out = []
    for mode in ExecMode:
        mine = [e for per in fleet.online_error for e in per if e.mode is mode and e.num_steps]
        n = sum(e.num_steps for e in mine)
        if n:
            out.append(ModeError(mode.value, sum(e.mape * e.num_steps for e in mine) / n, n,
                                 None, 0))
    return tuple(out)


def hardware_share(spec: SystemSpec, replicas: int, tp: int) -> HardwareShare:
    """Every system has ``replicas`` × ``tp`` GPUs; a standalone trainer (split-pool's)
    reserves ``spec.trainer_replicas`` replicas' worth, every other system gives the host all
    of them (training shares them)."""
    gpus = replicas * tp
    reserved = tp * spec.trainer_replicas
    return HardwareShare(gpus, gpus - reserved, reserved)


def system_run(spec: SystemSpec, fleet: FleetRun, commits: list[Commit],
               share: HardwareShare) -> SystemRun:
    """``slo_scale`` None: the simulated bench runs at the fixed SLO it is given."""
    return SystemRun(spec, replay_result(fleet), commits, latency_errors(fleet), share)


def harvest_base(pilot: SimOutcome | None, standalone_tokens_per_s: float, gpus: int,
                 tp: int, window_s: float) -> HarvestBase:
    """The inference-only run's idle GPU-seconds in the window of ``window_s`` simulated
    seconds (a step that ends after it counts its part inside it). Without a pilot nothing is
    known to be idle (and a rate of 0 leaves every ratio None); commits still count in the
    window."""
    if pilot is None:
        return HarvestBase(M.IdleCapacity(gpus, 0.0, 0.0), 0.0, tp, window_s)
    r = pilot.run.result
    idle = M.idle_capacity(r.steps, window_s, pilot.run.share.cores, tp,
                           end_s=r.start_s + window_s)
    return HarvestBase(idle, standalone_tokens_per_s, tp, window_s, r.wall_s)


@dataclass(frozen=True)
class Tails:
    """p95 and mean of TTFT and end-to-end latency, ms (the ablations' measure)."""

    ttft_p95_ms: float | None
    e2e_p95_ms: float | None
    ttft_mean_ms: float | None
    e2e_mean_ms: float | None


def tails(records: Sequence[RequestRecord]) -> Tails:
    ttft = [r.ttft_s for r in records if r.ttft_s is not None]
    e2e = [r.e2e_s for r in records if r.e2e_s is not None]

    def pct(v: list[float], q: float) -> float | None:
        return float(np.percentile(v, q)) * 1e3 if v else None

    def mean(v: list[float]) -> float | None:
        return float(np.mean(v)) * 1e3 if v else None

    return Tails(pct(ttft, 95), pct(e2e, 95), mean(ttft), mean(e2e))


@dataclass(frozen=True)
class SimScore:
    """The bench's score of one system, its tail latencies and the simulation's own figures:
    GPU busy time, the data-parallel barrier's wait, simulated seconds per wall second."""

    score: SystemScore
    tails: Tails
    busy_gpu_s: float
    fleet: FleetRun

    def as_json(self) -> dict:
        f, share = self.fleet, self.score.share
        return self.score.as_json() | asdict(self.tails) | {
            "gpus": share.cores, "reserved_gpus": share.reserved, "busy_gpu_s": self.busy_gpu_s,
            "idle_gpu_share": 1.0 - self.busy_gpu_s / (share.cores * f.end_s)
            if f.end_s else None,
            "barrier_wait_s": f.barrier_wait_s, "global_steps": f.global_steps,
            "simulated_s": f.end_s, "wall_s": f.wall_s,
            "simulated_s_per_wall_s": f.end_s / f.wall_s if f.wall_s else None,
            "cpu_s": f.cpu_s, "simulated_s_per_cpu_s": f.end_s / f.cpu_s if f.cpu_s else None,
            "events": f.events, "timed_out": f.timed_out}


def score(out: SimOutcome, slo: SLOConfig, base: HarvestBase) -> SimScore:
    r = out.run.result
    return SimScore(score_run(out.run, slo, base), tails(r.records),
                    sum(s.seconds for s in r.steps) * out.tp, out.fleet)
