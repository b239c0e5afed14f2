"""Open-loop trace replay: every request is sent at its scheduled time, whatever the server's
state, and every token's time is recorded.

TTFT is measured from the *scheduled* arrival, so a client that could not send on time (the
server process was busy) counts against the server, as a real client would see it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from deltaserve.core.contract import StepRecord
from deltaserve.core.requests import RequestOutput, SamplingParams
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


ROUTER = "round-robin"  # how replay_fleet routes requests (results.json names it)


def round_robin(index: int, num_hosts: int) -> int:
    """The router: request ``index`` of the trace goes to host ``index mod num_hosts`` (equal
    shares of every stretch of the trace, whatever its lengths)."""
    return index % num_hosts


def _unfinished(hosts: Sequence[BaseHost]) -> bool:
    return any(h.has_unfinished() for h in hosts)


def _loop(host: BaseHost, stop: threading.Event, threads: int,
          errors: list[BaseException]) -> None:
    """A replica's loop on a thread of its own. OpenMP keeps its thread count per thread (a
    new one starts from the default, every core), so the caller's is applied here first. A
    loop that raises stops the replay (the caller raises it)."""
    try:
        torch.set_num_threads(threads)
        host.run_loop(stop)
    except BaseException as e:  # re-raised on the caller's thread
        errors.append(e)
        stop.set()


def _send(hosts: Sequence[BaseHost], records: list[RequestRecord], trace: Trace,
          prompts: PromptSource, start: float, bar: tqdm) -> None:
    """Send every request at its scheduled time to the host the router names."""
    for rec, req in zip(records, trace.requests, strict=True):
        rec.scheduled_s = start + req.arrival_s
        delay = rec.scheduled_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        host = hosts[round_robin(rec.index, len(hosts))]
        host.add_request(prompts.prompt(rec.index, rec.prompt_tokens),
                         SamplingParams(max_tokens=rec.output_tokens, ignore_eos=True),
                         callback=rec.on_token)
        bar.update(1)


def replay_fleet(hosts: Sequence[BaseHost], trace: Trace, prompts: PromptSource, *,
                 label: str = "replay", drain_timeout_s: float = 300.0, min_wall_s: float = 0.0,
                 progress: bool = True) -> list[ReplayResult]:
    """:func:`replay` against replicas: one client sends the trace, each request to the host
    :func:`round_robin` names, and every host's loop runs until the window closes (the first
    in the calling thread, the others each in a thread of its own, on the caller's torch
    thread count). One result per host, with its own requests and steps and the fleet's
    common start and end."""
    records = [RequestRecord(i, 0.0, r.prompt_tokens, r.output_tokens)
               for i, r in enumerate(trace.requests)]
    steps: list[list[StepRecord]] = [[] for _ in hosts]
    for host, host_steps in zip(hosts, steps, strict=True):
        host.subscribe_steps(host_steps.append)
    stop = threading.Event()
    bar = tqdm(total=len(records), desc=label, unit="req", disable=not progress,
               dynamic_ncols=True)
    start = time.monotonic() + 0.2
    outcome: dict[str, float | bool] = {}

    def client() -> None:
        try:
            _send(hosts, records, trace, prompts, start, bar)
            deadline = time.monotonic() + drain_timeout_s
            while _unfinished(hosts) and time.monotonic() < deadline:
                time.sleep(0.02)
            outcome["timed_out"] = _unfinished(hosts)
            while time.monotonic() < start + min_wall_s:
                time.sleep(0.02)
        finally:
            outcome["end"] = time.monotonic()
            stop.set()

    sender = threading.Thread(target=client, name="replay-client", daemon=True)
    threads = torch.get_num_threads()  # the calling thread's: what the hosts were built with
    errors: list[BaseException] = []
    loops = [threading.Thread(target=_loop, args=(h, stop, threads, errors),
                              name=f"replica-{r}", daemon=True)
             for r, h in enumerate(hosts) if r > 0]
    sender.start()
    for t in loops:
        t.start()
    try:
        hosts[0].run_loop(stop)
    finally:
        stop.set()
        sender.join()
        for t in loops:
            t.join()
        bar.close()
        for host, host_steps in zip(hosts, steps, strict=True):
            host.unsubscribe_steps(host_steps.append)
    if errors:
        raise errors[0]
    n = len(hosts)
    return [ReplayResult([rec for rec in records if round_robin(rec.index, n) == r], start,
                         float(outcome["end"]), trace.duration_s, steps[r],
                         bool(outcome.get("timed_out", True)))
            for r in range(n)]
