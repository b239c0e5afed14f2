"""The fleet's routers (``bench --router``): each choice checked against a brute-force oracle
that keeps its own in-flight counts from the history of routes and finishes; a replica whose
loop fails is routed around by the fleet's replay, the others finish every request sent them,
and the replay still fails (a failed replica is never scored as an idle one); least-loaded
keeps short requests off a replica busy with a long one."""

from __future__ import annotations

import random
import threading
import time

import pytest

from deltaserve.bench.config import BenchConfig
from deltaserve.bench.replay import PromptSource, ReplicaFailed, replay_fleet
from deltaserve.core.errors import InputError
from deltaserve.core.router import (
    ROUTERS,
    LeastLoaded,
    NoLiveReplica,
    RoundRobin,
    create_router,
)
from deltaserve.workloads.trace import from_arrivals
from tests.bench.test_replay import FakeHost


# ---- the oracle -------------------------------------------------------------------------------
def oracle_choice(name: str, index: int, n: int, in_flight: list[int], down: set[int]) -> int:
    """Brute force: round-robin counts off the live replicas; least-loaded scans every replica
    from ``index mod n`` onwards, keeping the first with the smallest count."""
    live = [r for r in range(n) if r not in down]
    if name == "round-robin":
        return live[index % len(live)]
    best = None
    for k in range(n):
        r = (index + k) % n
        if r in down:
            continue
        if best is None or in_flight[r] < in_flight[best]:
            best = r
    assert best is not None
    return best


@pytest.mark.parametrize("name", sorted(ROUTERS))
@pytest.mark.parametrize("seed", range(20))
def test_every_choice_matches_the_oracle(name, seed):
    rng = random.Random(seed)
    n = rng.randint(1, 5)
    router = create_router(name, n)
    in_flight = [0] * n  # the oracle's own count, from the history alone
    down: set[int] = set()
    index = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.55:
            if len(down) == n:
                with pytest.raises(NoLiveReplica):
                    router.route(index)
                continue
            want = oracle_choice(name, index, n, in_flight, down)
            assert router.route(index) == want, (index, in_flight, down)
            in_flight[want] += 1
            index += 1
        elif op < 0.95:
            busy = [r for r in range(n) if in_flight[r]]
            if busy:
                r = rng.choice(busy)
                router.finished(r)
                in_flight[r] -= 1
        elif len(down) < n:
            r = rng.randrange(n)
            router.mark_down(r)
            down.add(r)
        assert list(router.in_flight) == in_flight


def test_round_robin_is_index_mod_n_and_least_loaded_rotates_ties():
    assert [RoundRobin(3).route(i) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    ll = LeastLoaded(3)
    assert [ll.route(i) for i in range(3)] == [0, 1, 2]  # idle: round-robin
    ll.finished(1)
    assert ll.route(3) == 1  # the only one with nothing in flight
    rr = RoundRobin(3)
    rr.mark_down(1)
    assert [rr.route(i) for i in range(4)] == [0, 2, 0, 2]


def test_a_finish_never_routed_is_a_bug_and_a_bad_router_names_the_flag():
    with pytest.raises(RuntimeError, match="never routed"):
        LeastLoaded(2).finished(0)
    with pytest.raises(InputError) as e:
        BenchConfig(router="random")
    assert e.value.field == "router" and "least-loaded" in str(e.value)
    assert BenchConfig().router == "round-robin"
    with pytest.raises(InputError) as e:
        create_router("least-loaded", 0)
    assert e.value.field == "replicas"


# ---- a replica fails mid-replay ---------------------------------------------------------------
class FailingHost(FakeHost):
    """An engine that dies on receiving its ``fail_on``-th request: its loop raises, and it
    answers nothing (what it held is lost)."""

    def __init__(self, fail_on: int):
        super().__init__()
        self.fail_on = fail_on
        self._due = threading.Event()

    def add_request(self, prompt, params=None, *, adapter=None, callback=None, request_id=None):
        self.sent.append((time.monotonic(), list(prompt)))
        if len(self.sent) >= self.fail_on:
            self._due.set()
        return "r"

    def run_loop(self, stop, idle_wait_s=0.005):
        while not stop.is_set():
            if self._due.wait(0.01):
                raise RuntimeError("engine died")

    def has_unfinished(self):
        return bool(self.sent)  # never answers


def spaced_trace(n: int, gap_s: float = 0.1, output_tokens: int = 2):
    return from_arrivals("t", [gap_s * i for i in range(n)], [5] * n, [output_tokens] * n,
                         gap_s * n, "test")


@pytest.mark.parametrize("failing", [0, 1])  # 0: the loop on the calling thread
def test_a_failed_replica_is_routed_around_and_the_replay_still_fails(failing):
    hosts = [FakeHost(), FakeHost()]
    hosts[failing] = FailingHost(fail_on=2)
    t0 = time.monotonic()
    with pytest.raises(ReplicaFailed) as e:
        replay_fleet(hosts, spaced_trace(10), PromptSource(list(range(100))),
                     drain_timeout_s=30.0, progress=False)
    assert time.monotonic() - t0 < 10.0  # nobody waited on the dead replica's requests
    assert e.value.replica == failing
    assert isinstance(e.value.__cause__, RuntimeError)
    assert str(e.value.__cause__) == "engine died"
    results = e.value.results
    other = 1 - failing
    # round-robin until the failure (its 2nd request, index failing + 2), the survivor after
    dead = [failing, failing + 2]
    assert [rec.index for rec in results[failing].records] == dead
    assert not any(rec.finished for rec in results[failing].records)
    assert [rec.index for rec in results[other].records] == \
        [i for i in range(10) if i not in dead]
    assert all(rec.finished for rec in results[other].records)
    assert len(hosts[other].sent) == 8 and not results[other].timed_out


def test_with_every_replica_down_the_replay_stops_and_fails():
    hosts = [FailingHost(fail_on=1), FailingHost(fail_on=1)]
    t0 = time.monotonic()
    with pytest.raises(ReplicaFailed) as e:
        replay_fleet(hosts, spaced_trace(6), PromptSource(list(range(100))),
                     drain_timeout_s=30.0, min_wall_s=30.0, progress=False)
    assert time.monotonic() - t0 < 10.0
    assert [[rec.index for rec in r.records] for r in e.value.results] == [[0], [1]]
    assert [len(h.sent) for h in hosts] == [1, 1]  # the rest had nowhere to go


# ---- least-loaded in a replay ------------------------------------------------------------------
class SlowHost(FakeHost):
    """Every token 0.6 s apart: a replica busy with a long answer."""

    def token_gap_s(self, k: int) -> float:
        return 0.6


@pytest.mark.parametrize("name, slow_gets", [("round-robin", 5), ("least-loaded", 1)])
def test_least_loaded_keeps_requests_off_a_busy_replica(name, slow_gets):
    """Replica 0 takes 0.6 s a token (its first request lasts 2.4 s), replica 1 answers in
    about 50 ms; requests come every 0.2 s for 2 s. Round-robin gives each half; least-loaded
    sends replica 0 only the first (it never has fewer in flight than replica 1 afterwards)."""
    hosts = [SlowHost(), FakeHost()]
    results = replay_fleet(hosts, spaced_trace(10, 0.2, 4), PromptSource(list(range(100))),
                           router=create_router(name, 2), progress=False)
    assert len(hosts[0].sent) == slow_gets and len(hosts[1].sent) == 10 - slow_gets
    assert all(rec.finished for r in results for rec in r.records)
