"""``deltaserve bench --replicas N``: every system as N data-parallel replicas of the host (the
native host's as threads of this process, described here; vLLM's as processes of their own,
:mod:`deltaserve.bench.replica_processes`, formed, trained and scored alike).

How replicas are formed: each replica is its own engine on ``threads // N`` of the machine's
threads (torch's thread count is one per process, so every replica gets the same), with its own
latency model (a copy of the calibration at that thread count) and, for a co-serving system, its
own co-server, attached as rank r of N (``CoServeConfig.data_parallel``): its backward process
joins one gloo group of the N backward processes (rendezvous on a free local port), trains its
:class:`~deltaserve.core.shard.DataShard` of every epoch and all-reduces every optimizer step's
gradient, so the replicas train one adapter (:mod:`deltaserve.train.group_steps` keeps their
steps in lock-step). The replicas attach, and detach, concurrently: the group forms, and lets
its members go, only with all of them. One client replays the trace, routing each request by
``--router`` (:mod:`deltaserve.core.router`: request i to replica ``i mod N``, or to the one
with the fewest requests in flight); every replica's loop runs until the window closes. A
replica whose loop fails is routed around until the window closes, and the run then fails
(:class:`~deltaserve.bench.replay.ReplicaFailed`): a failed replica is never scored as an idle
one. inference-only runs the same replicas without training.

Scoring: the run's ``result`` and ``commits`` are the fleet's (every replica's requests, steps
and commits), so every system is scored as a whole by the bench's usual path (the pilot's idle
capacity counts each step on its replica's cores); :mod:`deltaserve.bench.fleet_score` adds
each replica's FT tokens/s and SLO attainment and the all-reduce time per step.

Assumed: one process holds every replica (the engines' steps run concurrently in threads, the
GIL held only between kernels), the machine's threads split evenly, and no replica failure in
a scored run (a failed one fails the run).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from deltaserve.bench.config import REPLICA_HOSTS, BenchConfig
from deltaserve.bench.coserve_config import coserve_config
from deltaserve.bench.execute import (
    RunInputs,
    bench_training,
    grant_policy,
    record_commits,
    warm_up,
)
from deltaserve.bench.latency_holdout import (
    HoldoutLatencyModel,
    KindError,
    ModeError,
    errors_by_kind,
    errors_by_mode,
)
from deltaserve.bench.outcome import HardwareShare, ReplicaRun, SystemRun
from deltaserve.bench.prepare import make_host
from deltaserve.bench.replay import ReplayResult, replay_fleet
from deltaserve.bench.replica_processes import run_processes, tasks_for
from deltaserve.bench.systems import SystemSpec
from deltaserve.core.errors import require
from deltaserve.core.router import create_router
from deltaserve.core.slo import SLOConfig
from deltaserve.hosts.base import BaseHost
from deltaserve.hosts.replica_group import at_once, attach_group, detach_group, free_port, ranked
from deltaserve.train.checkpoint_store import find_latest
from deltaserve.train.config import CoServeConfig, GrantPolicy
from deltaserve.train.facade import CoServer


def threads_per_replica(cfg: BenchConfig, threads: int) -> int:
    return max(1, threads // cfg.replicas)


def check_replicas(cfg: BenchConfig, specs: Sequence[SystemSpec], threads: int) -> None:
    """Refuse, before any model loads, replicas the machine or a system cannot run."""
    if cfg.replicas == 1:
        return
    require(cfg.replicas <= threads, "replicas", cfg.replicas,
            f"each replica needs a thread of its own; this machine gives torch {threads}")
    for spec in specs:
        require(not spec.trainer_replicas, "replicas", cfg.replicas,
                f"{spec.name} trains beside the host on reserved cores: it has no replicas "
                f"(drop it from --systems)")
        require(not spec.coserve or grant_policy(cfg, spec) is not GrantPolicy.PARTITION,
                "replicas", cfg.replicas, f"{spec.name}: a partitioned backward reserves "
                f"cores that replicas of one thread do not have")


def replica_config(inputs: RunInputs, spec: SystemSpec, slo: SLOConfig, root: Path,
                   threads: int) -> CoServeConfig:
    """Every replica's co-server configuration, before its rank: the backward on ``threads``
    (the replica's share; stated, since an attaching thread's own torch count is OpenMP's
    default) and one checkpoint root for the group (rank 0 writes there, every rank its
    log)."""
    config = coserve_config(spec, bench_training(inputs.cfg, slo, root))
    b = config.backward
    return replace(config, backward=replace(b, threads=b.threads or threads))


def fleet_result(results: Sequence[ReplayResult]) -> ReplayResult:
    """The replicas' results as one: every request (in trace order) and every step."""
    first = results[0]
    records = sorted((rec for r in results for rec in r.records), key=lambda rec: rec.index)
    steps = sorted((s for r in results for s in r.steps), key=lambda s: s.t_s)
    return ReplayResult(records, first.start_s, first.end_s, first.trace_duration_s, steps,
                        any(r.timed_out for r in results))


@dataclass(frozen=True)
class _Replicated:
    """What the replicas of one system's run left: each one's share, and the latency model's
    errors (replica 0's: every replica's model starts from one calibration and sees its own
    share of the same trace)."""

    replicas: tuple[ReplicaRun, ...]
    latency: tuple[ModeError, ...]
    kinds: tuple[KindError, ...]


def _in_threads(inputs: RunInputs, spec: SystemSpec, slo: SLOConfig | None, root: Path,
                per: int, label: str) -> _Replicated:
    """The replicas as hosts of this process, each loop on a thread of its own."""
    cfg = inputs.cfg
    hosts: list[BaseHost] = []
    try:
        for _ in range(cfg.replicas):
            hosts.append(make_host(cfg, per))
        lms = []
        for host in hosts:
            warm_up(host, inputs.data.prompts)
            lm = HoldoutLatencyModel.load(inputs.lm_paths[per])
            lm.every = cfg.latency_holdout_every
            host.latency_model = lm
            lms.append(lm)
        cos: list[CoServer] = []
        if spec.coserve:
            assert slo is not None, "a co-serving system needs a SLO"
            cos = attach_group(hosts, replica_config(inputs, spec, slo, root, per),
                               dataset=inputs.data.samples, scheduler_cls=spec.scheduler_cls)
        recorded = [record_commits(co) for co in cos] or [([], []) for _ in hosts]
        results = replay_fleet(hosts, inputs.trace, inputs.data.prompts,
                               router=create_router(cfg.router, len(hosts)), label=label,
                               min_wall_s=cfg.window_s(inputs.trace.duration_s),
                               progress=cfg.progress)
        for co in cos:  # a run whose backward lost every step is an error, not 0 tokens/s
            co.raise_if_failed()
        if cos:
            detach_group(hosts, drain=False, checkpoint=True)
        min_s = cfg.latency_error_min_ms / 1e3
        return _Replicated(tuple(ReplicaRun(r, res, commits, reduce_s)
                                 for r, (res, (commits, reduce_s))
                                 in enumerate(zip(results, recorded, strict=True))),
                           errors_by_mode(lms[0], min_s), errors_by_kind(lms[0], min_s))
    finally:
        # detach any co-server still attached (an error path) on every replica at once: each
        # sends its peers empty shares until all have closed
        at_once([lambda h=h: h.close() for h in hosts])


def _in_processes(inputs: RunInputs, spec: SystemSpec, slo: SLOConfig | None, root: Path,
                  per: int, label: str) -> _Replicated:
    """The replicas as processes (:mod:`deltaserve.bench.replica_processes`)."""
    n = inputs.cfg.replicas
    configs: list[CoServeConfig | None] = [None] * n
    if spec.coserve:
        assert slo is not None, "a co-serving system needs a SLO"
        config, port = replica_config(inputs, spec, slo, root, per), free_port()
        configs = [ranked(config, r, n, port) for r in range(n)]
    outcomes = run_processes(tasks_for(inputs, spec, configs, label, per))
    return _Replicated(tuple(o.run for o in outcomes), outcomes[0].latency, outcomes[0].kinds)


def run_replicated(inputs: RunInputs, spec: SystemSpec, slo: SLOConfig | None,
                   slo_scale: float | None, *, label: str | None = None, tag: str = ""
                   ) -> SystemRun:
    """:func:`~deltaserve.bench.execute.run_system` for ``--replicas`` N > 1 (the same
    arguments): the trace against N replicas of the host, training one adapter; the replicas
    are threads of this process, or processes where the host's engines cannot share one
    (:data:`~deltaserve.bench.config.REPLICA_HOSTS`)."""
    cfg = inputs.cfg
    per = threads_per_replica(cfg, inputs.threads)
    if label is None:
        label = spec.name if slo_scale is None else f"{spec.name} @{slo_scale:g}"
    label += tag
    root = inputs.work / "checkpoints" / label.replace(" @", "-").replace(" #", "-")
    run_ = _in_threads if REPLICA_HOSTS[cfg.host] else _in_processes
    done = run_(inputs, spec, slo, root, per, label)
    run = SystemRun(spec, fleet_result([rep.result for rep in done.replicas]),
                    [c for rep in done.replicas for c in rep.commits], done.latency,
                    HardwareShare(inputs.threads, per, 0), slo_scale,
                    latency_kinds=done.kinds, replicas=done.replicas)
    if spec.coserve:
        latest = find_latest(root)
        run.adapter_dir = str(latest) if latest else None
        run.train_log = str(root / "train_log.jsonl")  # rank 0's
    return run
