"""Replicas as processes (``deltaserve bench --host vllm --replicas N``): each replica's share of
the trace is round-robin's (checked against ``i mod N``), a share replays with its requests'
trace-wide indices and prompts from a common start, each replica gets cores of its own, and a
replica that fails or dies fails the run with its rank and cause, leaving no process behind.
(The end-to-end bench through processes is in ``test_replicas.py``, parametrized.)"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from deltaserve.bench.config import BenchConfig
from deltaserve.bench.replay import PromptSource, replay_fleet
from deltaserve.bench.replica_processes import (
    ReplicaProcessFailed,
    ReplicaTask,
    gather,
    replica_cores,
    run_processes,
    shares,
)
from deltaserve.bench.systems import parse_systems
from deltaserve.hosts.config import HostConfig
from deltaserve.workloads.trace import from_arrivals
from tests.bench.test_replay import FakeHost


def _trace(n: int):
    return from_arrivals("t", [0.01 * i for i in range(n)], [3 + i for i in range(n)],
                         [2] * n, 0.5, "test")


@pytest.mark.parametrize("n, replicas", [(1, 1), (5, 2), (7, 3), (2, 3)])
def test_each_replica_gets_the_requests_round_robin_gives_it(n, replicas):
    trace = _trace(n)
    got = shares(trace, replicas)
    assert len(got) == replicas
    for r, (idx, sub) in enumerate(got):
        assert idx == tuple(i for i in range(n) if i % replicas == r)  # the oracle: i mod N
        assert sub.requests == tuple(trace.requests[i] for i in idx)
        assert sub.duration_s == trace.duration_s
    assert sorted(i for idx, _ in got for i in idx) == list(range(n))


def test_a_share_replays_from_the_common_start_with_its_trace_wide_indices():
    trace = _trace(5)
    prompts = PromptSource(list(range(1000)))
    idx, sub = shares(trace, 2)[1]
    host = FakeHost()
    start_s = time.monotonic() + 0.3
    result = replay_fleet([host], sub, prompts, start_s=start_s, indices=idx,
                          progress=False)[0]
    assert result.start_s == start_s
    assert [rec.index for rec in result.records] == [1, 3]
    # each prompt is the one the whole trace's request of that index gets
    assert [p for _, p in host.sent] == [prompts.prompt(i, trace.requests[i].prompt_tokens)
                                         for i in idx]
    assert all(t >= start_s + trace.requests[i].arrival_s - 1e-3
               for (t, _), i in zip(host.sent, idx, strict=True))
    with pytest.raises(Exception, match="indices"):
        replay_fleet([FakeHost()], sub, prompts, indices=idx[:1], progress=False)


def test_each_replica_has_cores_of_its_own():
    allowed = sorted(os.sched_getaffinity(0))
    per = max(1, len(allowed) // 2)
    cores = [replica_cores(r, per) for r in range(2)]
    assert all(len(c) == per for c in cores)
    if len(allowed) >= 2:
        assert not set(cores[0]) & set(cores[1])
    assert set(cores[0]) | set(cores[1]) <= set(allowed)


def _task(rank: int, model: str) -> ReplicaTask:
    trace = _trace(2)
    return ReplicaTask(BenchConfig(engine=HostConfig(model=model), progress=False),
                       parse_systems("inference-only")[0], rank, (sorted(
                           os.sched_getaffinity(0))[0],), "missing.json", trace, (0, 1),
                       PromptSource(list(range(100))), [], None, "t", 1.0)


def test_a_replica_that_fails_fails_the_run_with_its_rank_and_cause(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ReplicaProcessFailed) as e:
        run_processes([_task(0, missing), _task(1, missing)])
    assert "failed before ready" in str(e.value) and "no-such-model" in str(e.value)
    assert not mp.active_children()  # every replica process was ended


def test_a_replica_process_that_dies_is_named_with_its_exit_code():
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=os._exit, args=(3,))]
    procs[0].start()
    procs[0].join()
    with pytest.raises(ReplicaProcessFailed, match=r"replica 0's process died \(exit code 3\)"):
        gather(ctx.Queue(), procs, time.monotonic() + 30, "ready")
