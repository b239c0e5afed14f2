"""Open-loop trace replay: every request is sent at its scheduled time, whatever the server's
state, and every token's time is recorded.

TTFT is measured from the *scheduled* arrival, so a client that could not send on time (the
server process was busy) counts against the server, as a real client would see it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from deltaserve.core.contract import StepRecord
from deltaserve.core.errors import require
from deltaserve.core.requests import RequestOutput, SamplingParams
from deltaserve.core.router import NoLiveReplica, RoundRobin, Router
from deltaserve.hosts.base import BaseHost
from deltaserve.workloads.trace import Trace


class PromptSource:
    """Real text as one token stream; a prompt of n tokens is a slice of it, so prompts are
    real language of exactly the length the trace asks for."""

    def __init__(self, token_stream: Sequence[int]):
        if len(token_stream) < 64:
            raise ValueError("the prompt text is too short to cut prompts from")
        self.stream = list(token_stream)

    @classmethod
    def from_texts(cls, tokenizer, texts: Sequence[str], max_tokens: int = 200_000
                   ) -> PromptSource:
        stream: list[int] = []
        for text in texts:
            stream += tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"]
            if len(stream) >= max_tokens:
                break
        return cls(stream)

    def prompt(self, index: int, num_tokens: int) -> list[int]:
        """``num_tokens`` tokens from a position set by ``index`` (wrapping around)."""
        pos = (index * 7919) % len(self.stream)
        out: list[int] = []
        while len(out) < num_tokens:
            take = min(num_tokens - len(out), len(self.stream) - pos)
            out += self.stream[pos:pos + take]
            pos = 0
        return out


@dataclass
class RequestRecord:
    """One replayed request; times are seconds on ``time.monotonic()``."""

    index: int
    scheduled_s: float
    prompt_tokens: int
    output_tokens: int
    token_times_s: tuple[float, ...] = ()
    finished: bool = False

    def on_token(self, out: RequestOutput) -> None:
        self.token_times_s = out.token_times_s
        self.finished = out.finished

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.scheduled_s if self.token_times_s else None

    @property
    def max_tpot_s(self) -> float:
        """The longest gap between two consecutive tokens (0 with fewer than two)."""
        return max((b - a for a, b in itertools.pairwise(self.token_times_s)), default=0.0)

    @property
    def e2e_s(self) -> float | None:
        return self.token_times_s[-1] - self.scheduled_s if self.finished else None


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    start_s: float
    end_s: float
    trace_duration_s: float
    steps: list[StepRecord] = field(default_factory=list)
    timed_out: bool = False

    @property
    def wall_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def drained_s(self) -> float | None:
        """Seconds from the start to the last token of any request (None: no token)."""
        last = [r.token_times_s[-1] for r in self.records if r.token_times_s]
        return max(last) - self.start_s if last else None


def replay(host: BaseHost, trace: Trace, prompts: PromptSource, *, label: str = "replay",
           drain_timeout_s: float = 300.0, min_wall_s: float = 0.0,
           progress: bool = True) -> ReplayResult:
    """Send ``trace`` to ``host`` and wait until every request finished or
    ``drain_timeout_s`` passed after the last arrival, and in any case until ``min_wall_s``
    after the start: the host's loop (and the training it carries) runs until the scoring
    window closes, however early the requests drained.

    The engine loop runs in the calling thread and the client in a second one: torch's OpenMP
    workers belong to the thread that first ran a parallel region, and a second thread running
    the model would compete with their spin-waits (steps measured 1.7x slower on 2 cores).
    """
    return replay_fleet([host], trace, prompts, label=label, drain_timeout_s=drain_timeout_s,
                        min_wall_s=min_wall_s, progress=progress)[0]


class ReplicaFailed(RuntimeError):
    """A replica's loop raised during a fleet replay (its error is the cause). The router sent
    the later requests to the live replicas and the replay ran to its end: ``results`` are
    every replica's, as :func:`replay_fleet` returns them, the failed one's unfinished requests
    included. Raised so that a failed replica never passes for an idle one."""

    def __init__(self, replica: int, results: list[ReplayResult]):
        super().__init__(f"replica {replica}'s loop failed; its later requests went to the "
                         f"live replicas")
        self.replica = replica
        self.results = results


def _unfinished(hosts: Sequence[BaseHost], router: Router) -> bool:
    """A live replica still has requests to finish (a failed one never will)."""
    return any(h.has_unfinished() for r, h in enumerate(hosts) if router.is_live(r))


def _loop(replica: int, host: BaseHost, stop: threading.Event, threads: int, router: Router,
          errors: list[tuple[int, BaseException]]) -> None:
    """A replica's loop. OpenMP keeps its thread count per thread (a new one starts from the
    default, every core), so the caller's is applied here first. A loop that raises is marked
    down in the router, which routes around it; the others go on (the caller raises the
    error after the replay), and the replay stops once no replica is live, or at once on an
    interrupt (a ``BaseException`` that is no ``Exception``)."""
    try:
        torch.set_num_threads(threads)
        host.run_loop(stop)
    except BaseException as e:  # re-raised on the caller's thread
        errors.append((replica, e))
        router.mark_down(replica)
        if not isinstance(e, Exception) or not router.any_live:
            stop.set()


def _counted(rec: RequestRecord, router: Router, replica: int) -> Callable[[RequestOutput], None]:
    """``rec``'s token callback, telling the router once when the request finishes."""
    def on_token(out: RequestOutput) -> None:
        was_finished = rec.finished
        rec.on_token(out)
        if out.finished and not was_finished:
            router.finished(replica)
    return on_token


def _send(hosts: Sequence[BaseHost], router: Router, records: list[RequestRecord],
          assigned: dict[int, int], trace: Trace, prompts: PromptSource, start: float,
          bar: tqdm) -> None:
    """Send every request at its scheduled time to the replica the router names (and note
    it in ``assigned``), until no replica is live."""
    for rec, req in zip(records, trace.requests, strict=True):
        rec.scheduled_s = start + req.arrival_s
        delay = rec.scheduled_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        try:
            replica = router.route(rec.index)
        except NoLiveReplica:
            return  # every replica failed: the rest of the trace has nowhere to go
        assigned[rec.index] = replica
        hosts[replica].add_request(prompts.prompt(rec.index, rec.prompt_tokens),
                                   SamplingParams(max_tokens=rec.output_tokens,
                                                  ignore_eos=True),
                                   callback=_counted(rec, router, replica))
        bar.update(1)


def replay_fleet(hosts: Sequence[BaseHost], trace: Trace, prompts: PromptSource, *,
                 router: Router | None = None, label: str = "replay",
                 drain_timeout_s: float = 300.0, min_wall_s: float = 0.0,
                 progress: bool = True, start_s: float | None = None,
                 indices: Sequence[int] | None = None) -> list[ReplayResult]:
    """:func:`replay` against replicas: one client sends the trace, each request to the host
    ``router`` names (round-robin by default), and every host's loop runs until the window
    closes (the first in the calling thread, the others each in a thread of its own, on the
    caller's torch thread count). One result per host, with its own requests and steps and
    the fleet's common start and end. A replica whose loop raises is routed around and the
    replay goes on; :class:`ReplicaFailed` is raised at its end, with the results. ``start_s``:
    the start on ``time.monotonic()``, one clock for every process (default: now); ``indices``:
    each request's index in the whole trace, which its record and prompt keep."""
    router = _checked(router, len(hosts))
    records = _records(trace, indices)
    assigned: dict[int, int] = {}
    steps: list[list[StepRecord]] = [[] for _ in hosts]
    for host, host_steps in zip(hosts, steps, strict=True):
        host.subscribe_steps(host_steps.append)
    stop = threading.Event()
    bar = tqdm(total=len(records), desc=label, unit="req", disable=not progress,
               dynamic_ncols=True)
    start = time.monotonic() + 0.2 if start_s is None else start_s
    outcome: dict[str, float | bool] = {}

    def client() -> None:
        try:
            _send(hosts, router, records, assigned, trace, prompts, start, bar)
            outcome["timed_out"] = _drain(hosts, router, drain_timeout_s)
            while time.monotonic() < start + min_wall_s and router.any_live:
                time.sleep(0.02)
        finally:
            outcome["end"] = time.monotonic()
            stop.set()

    sender = threading.Thread(target=client, name="replay-client", daemon=True)
    threads = torch.get_num_threads()  # the calling thread's: what the hosts were built with
    errors: list[tuple[int, BaseException]] = []
    loops = [threading.Thread(target=_loop, args=(r, h, stop, threads, router, errors),
                              name=f"replica-{r}", daemon=True)
             for r, h in enumerate(hosts) if r > 0]
    sender.start()
    for t in loops:
        t.start()
    try:
        _loop(0, hosts[0], stop, threads, router, errors)
        stop.wait()  # a failed host 0 leaves the others serving until the replay ends
    finally:
        stop.set()
        sender.join()
        for t in loops:
            t.join()
        bar.close()
        for host, host_steps in zip(hosts, steps, strict=True):
            host.unsubscribe_steps(host_steps.append)
    results = [ReplayResult([rec for rec in records if assigned.get(rec.index) == r], start,
                            float(outcome["end"]), trace.duration_s, steps[r],
                            bool(outcome.get("timed_out", True))) for r in range(len(hosts))]
    _raise_first(errors, results)
    return results


def _records(trace: Trace, indices: Sequence[int] | None) -> list[RequestRecord]:
    """A record per request of ``trace``, each with its index (default: its position)."""
    indices = range(len(trace.requests)) if indices is None else indices
    require(len(indices) == len(trace.requests), "indices", len(indices),
            f"must name each of the trace's {len(trace.requests)} requests")
    return [RequestRecord(i, 0.0, r.prompt_tokens, r.output_tokens)
            for i, r in zip(indices, trace.requests, strict=True)]


def _checked(router: Router | None, num_hosts: int) -> Router:
    """``router`` (round-robin by default), refused unless it routes over ``num_hosts``."""
    router = router or RoundRobin(num_hosts)
    require(router.num_replicas == num_hosts, "router", router.num_replicas,
            f"routes over a different number of replicas than the {num_hosts} hosts")
    return router


def _drain(hosts: Sequence[BaseHost], router: Router, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for the live replicas' requests; whether any is unfinished."""
    deadline = time.monotonic() + timeout_s
    while _unfinished(hosts, router) and time.monotonic() < deadline:
        time.sleep(0.02)
    return _unfinished(hosts, router)


def _raise_first(errors: list[tuple[int, BaseException]], results: list[ReplayResult]) -> None:
    """The first replica's error, if any: an interrupt as it is, a failure as
    :class:`ReplicaFailed` carrying every replica's ``results``."""
    if errors:
        replica, error = errors[0]
        if not isinstance(error, Exception):
            raise error  # an interrupt, not a replica's failure
        raise ReplicaFailed(replica, results) from error
