"""N hosts in one process as the data-parallel replicas of one fine-tuning job: attached together
as ranks 0..N-1 of one group, detached together (``deltaserve bench --replicas``, ``deltaserve
serve --replicas``).

Why together: each replica's backward process joins the group as it starts (the rendezvous waits
for every rank), and a closing replica sends empty shares until every peer has closed
(:mod:`deltaserve.train.group_steps`), so one replica attached or detached alone would wait for
its peers until the group's timeout. The calls run on one thread per replica, and the first
error is raised once all of them have ended.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from deltaserve.core.admission import AdmissionScheduler
from deltaserve.core.data import TrainingSample
from deltaserve.hosts.base import BaseHost
from deltaserve.train.config import CoServeConfig
from deltaserve.train.facade import CoServer

T = TypeVar("T")


def free_port() -> int:
    """A free local port for the group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def at_once(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Run ``calls`` concurrently, one thread each, and return their results in order; the
    first error is raised after all have ended."""
    out: list[T | None] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as e:  # re-raised on the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), name=f"replica-{i}")
               for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out  # type: ignore[return-value]  # every call returned


def ranked(config: CoServeConfig, rank: int, world_size: int, port: int) -> CoServeConfig:
    """``config`` for rank ``rank`` of ``world_size`` replicas meeting on local ``port``."""
    return replace(config, data_parallel=replace(config.data_parallel, world_size=world_size,
                                                 rank=rank, master_port=port))


def attach_group(hosts: Sequence[BaseHost], config: CoServeConfig, *,
                 dataset: Sequence[TrainingSample], progress: bool = False,
                 scheduler_cls: type[AdmissionScheduler] = AdmissionScheduler,
                 validation: Sequence[TrainingSample] | None = None) -> list[CoServer]:
    """Attach ``config`` to every host, host r as rank r of ``len(hosts)`` (rendezvous on a
    free local port), each with its own latency model (``host.latency_model``). Only rank 0
    validates: every rank holds the same adapter."""
    port = free_port()
    n = len(hosts)

    def attach(rank: int) -> Callable[[], CoServer]:
        mine = ranked(config, rank, n, port)
        return lambda: hosts[rank].attach(mine, dataset=dataset,
                                          latency_model=hosts[rank].latency_model,
                                          progress=progress, scheduler_cls=scheduler_cls,
                                          validation=validation if rank == 0 else None)

    return at_once([attach(r) for r in range(n)])


def detach_group(hosts: Sequence[BaseHost], *, drain: bool, checkpoint: bool) -> None:
    """Detach every host's co-server at once (each keeps serving)."""
    at_once([lambda h=h: h.detach(drain=drain, checkpoint=checkpoint) for h in hosts])
