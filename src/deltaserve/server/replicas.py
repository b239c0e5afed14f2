"""``deltaserve serve --replicas N``: one service over N embedded engines in one process.

* **Requests** (:class:`ReplicaBackend`, the service's :class:`InferenceBackend`): each goes to
  the replica a :class:`~deltaserve.core.router.Router` picks (``--router``: round-robin or
  least-loaded, counting a request in flight until its last output, an abort's included).
  Request ids are the backend's own, unique across replicas; an abort goes to the replica that
  holds the request. A served adapter is added to, and removed from, every replica.
* **Fine-tuning jobs** (:class:`ReplicaGroup`, the runner's host): one queue, as with one
  engine; each job is attached to every replica at once as one data-parallel group
  (:mod:`deltaserve.hosts.replica_group`), trains each sample once per epoch across them, and
  every replica serves the same adapter. The runner reads the job through :class:`GroupJob`:
  rank 0's events, with each step's samples and tokens the whole group's (so the job's
  ``trained_tokens`` and its end count every replica's), and its loss rank 0's share's; the
  counters are rank 0's for what the adapter holds and the sum over replicas for admission.
  Checkpoints are rank 0's, in the job's directory (each rank logs there too); a job resumes
  on any number of replicas.
* **Statistics**: :class:`~deltaserve.server.serving_stats.HostServingStats` over every
  replica (request counters summed, the latency models' online errors pooled).

A replica whose engine fails (its loop raised: logged critical) is marked down
(:meth:`ReplicaBackend.replica_down`): the router sends it nothing more and the others serve
every new request. Requests it held when it failed get no more output (their clients time
out), as with any engine that dies mid-request.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from deltaserve.core.data import TrainingSample
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.requests import RequestOutput, SamplingParams, TokenCallback
from deltaserve.core.router import Router
from deltaserve.hosts.base import BaseHost
from deltaserve.hosts.replica_group import attach_group, detach_group
from deltaserve.server.coserving_runner import CoServingRunner
from deltaserve.train.config import CoServeConfig
from deltaserve.train.events import CoServeStats, Listener, OptimizerStep, TrainingEvent
from deltaserve.train.facade import CoServer

log = logging.getLogger("deltaserve.server")


class ReplicaBackend:
    """The replicas as one :class:`~deltaserve.server.protocols.InferenceBackend`."""

    def __init__(self, hosts: Sequence[BaseHost], router: Router):
        self.hosts, self.router = tuple(hosts), router
        first = self.hosts[0]
        self.model_name: str = first.model_name
        self.tokenizer = first.tokenizer
        self.max_model_len = first.max_model_len
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._where: dict[str, int] = {}  # request id -> its replica, until its last output

    def add_request(self, prompt: Sequence[int], params: SamplingParams, *,
                    adapter: str | None = None, callback: TokenCallback | None = None,
                    request_id: str | None = None) -> str:
        with self._lock:
            index = next(self._ids)
            rid = request_id if request_id is not None else f"req-{index}"
            if rid in self._where:
                raise ValueError(f"request id {rid!r} is in flight")
            replica = self.router.route(index)
            self._where[rid] = replica

        def on_output(out: RequestOutput) -> None:
            if out.finished:
                self._finished(rid, replica)
            if callback is not None:
                callback(out)

        try:
            return self.hosts[replica].add_request(prompt, params, adapter=adapter,
                                                   callback=on_output, request_id=rid)
        except BaseException:
            self._finished(rid, replica)
            raise

    def _finished(self, rid: str, replica: int) -> None:
        with self._lock:
            if self._where.pop(rid, None) is None:
                return
        self.router.finished(replica)

    def replica_down(self, replica: int) -> None:
        """``replica``'s engine stopped: route around it from now on."""
        log.critical("replica %d of %d is down; the others serve every new request", replica,
                     len(self.hosts))
        self.router.mark_down(replica)

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            replica = self._where.get(request_id)
        if replica is not None:
            self.hosts[replica].abort_request(request_id)

    def add_lora(self, name: str, path: str) -> None:
        for host in self.hosts:
            host.add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        for host in self.hosts:
            host.remove_lora(name)

    def lora_names(self) -> list[str]:
        return self.hosts[0].lora_names()


def group_stats(stats: Sequence[CoServeStats]) -> CoServeStats:
    """Rank 0's counters of what the adapter holds (the group's), every replica's admission
    and timing counters summed."""
    first = stats[0]
    skips: Counter[str] = Counter()
    lost: Counter[str] = Counter()
    for s in stats:
        skips.update(s.skips)
        lost.update(s.steps_lost)
    return replace(
        first, ft_tokens_forwarded=sum(s.ft_tokens_forwarded for s in stats),
        steps_with_ft=sum(s.steps_with_ft for s in stats),
        aborted_steps=sum(s.aborted_steps for s in stats),
        backward_failures=sum(s.backward_failures for s in stats),
        io_errors=sum(s.io_errors for s in stats), skips=dict(skips),
        ft_tokens_admitted=sum(s.ft_tokens_admitted for s in stats),
        steps_timed=sum(s.steps_timed for s in stats),
        step_time_predicted_s=sum(s.step_time_predicted_s for s in stats),
        step_time_measured_s=sum(s.step_time_measured_s for s in stats),
        backward_busy_s=sum(s.backward_busy_s for s in stats), steps_lost=dict(lost))


class GroupJob:
    """One job's co-servers, one per replica, as the runner reads one (``JobCoServer``)."""

    def __init__(self, cos: Sequence[CoServer], dataset: Sequence[TrainingSample]):
        self.cos = tuple(cos)
        self._tokens = [s.num_tokens for s in dataset]  # a pool's ids index the dataset

    def subscribe(self, listener: Listener) -> None:
        def group_view(ev: TrainingEvent) -> None:
            if isinstance(ev, OptimizerStep):
                ids = ev.group_sample_ids
                ev = replace(ev, sample_ids=ids, num_tokens=sum(self._tokens[i] for i in ids))
            listener(ev)

        self.cos[0].subscribe(group_view)

    def stats(self) -> CoServeStats:
        return group_stats([co.stats() for co in self.cos])


class ReplicaGroup:
    """The runner's host: every job on every replica at once (``CoServingHost``). Each
    replica co-serves under its own latency model (``host.latency_model``), so the runner's
    ``latency_model`` is not used."""

    def __init__(self, hosts: Sequence[BaseHost]):
        self.hosts = tuple(hosts)

    def attach(self, *, dataset: Sequence[TrainingSample], config: CoServeConfig,
               latency_model: LatencyModel | None, progress: bool,
               validation: Sequence[TrainingSample] | None) -> GroupJob:
        del latency_model  # each replica's own
        cos = attach_group(self.hosts, config, dataset=dataset, progress=progress,
                           validation=validation)
        return GroupJob(cos, dataset)

    def detach(self, *, drain: bool, checkpoint: bool) -> None:
        detach_group(self.hosts, drain=drain, checkpoint=checkpoint)


def replica_runner(hosts: Sequence[BaseHost], config: CoServeConfig,
                   max_sample_tokens: int) -> CoServingRunner:
    return CoServingRunner(ReplicaGroup(hosts), config, None, max_sample_tokens)
