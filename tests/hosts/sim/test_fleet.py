"""Data-parallel replicas: one shared pool trains every sample exactly once across them, one
optimizer step per round of the group, and the router spreads requests as stated."""

from __future__ import annotations

import collections
import itertools

import pytest

from deltaserve.core.slo import SLOConfig
from deltaserve.hosts.sim import standalone
from deltaserve.hosts.sim.backward import BackwardJob
from deltaserve.hosts.sim.calibrate import calibrate
from deltaserve.hosts.sim.config import SimHostConfig
from deltaserve.hosts.sim.fleet import CoServing, Fleet, Router
from deltaserve.hosts.sim.oracle import SimBatch
from deltaserve.train.config import CoServeConfig
from deltaserve.workloads.trace import Trace, TraceRequest
from tests.hosts.sim.conftest import samples

SLO = SLOConfig(0.4, 0.12)


def trace(n: int, every_s: float, prompt: int = 600, output: int = 40) -> Trace:
    reqs = tuple(TraceRequest(i * every_s, prompt + 37 * (i % 5), output) for i in range(n))
    return Trace("steady", reqs, n * every_s + 1)


@pytest.mark.parametrize("replicas", [2, 3])
def test_every_sample_once_per_epoch_across_replicas(hardware, replicas):
    cfg = SimHostConfig()
    fleet = Fleet(hardware, cfg, replicas, seed=1)
    data = samples(30, seed=replicas)
    lm = calibrate(hardware, fleet.engines[0].limits)
    pool = fleet.coserve(CoServing(CoServeConfig(SLO, num_epochs=3), lm, data,
                                   allreduce_s=0.002))
    run = fleet.replay(trace(100, 0.2))  # 20 s of requests; three epochs train meanwhile
    assert not run.timed_out and all(r.finished for r in run.requests)
    assert pool.progress().finished
    trained = collections.Counter((c.epoch, i) for c in run.commits for i in c.sample_ids)
    assert set(trained.values()) == {1}
    assert set(trained) == {(e, i) for e in range(3) for i in range(len(data))}
    assert len({c.epoch for c in run.commits}) == 3
    # requests went to every replica; a global step commits each replica's share at most once
    assert {r.replica for r in run.requests} == set(range(replicas))
    assert run.global_steps <= len(run.commits) <= replicas * run.global_steps
    fleet.close()
    assert pool.progress().samples_claimed == 0


def test_round_robin_and_least_loaded_routing(hardware):
    cfg = SimHostConfig()
    rr = Fleet(hardware, cfg, 4, Router.ROUND_ROBIN).replay(trace(40, 0.01))
    assert [r.replica for r in rr.requests] == [i % 4 for i in range(40)]
    # least-loaded: a replica stuck on one long request gets none of the short ones after it
    reqs = (TraceRequest(0.0, 7000, 1000),
            *(TraceRequest(0.01 + 0.3 * i, 100, 10) for i in range(30)))
    ll = Fleet(hardware, cfg, 2, Router.LEAST_LOADED).replay(Trace("skewed", reqs, 10.0))
    assert ll.requests[0].replica == 0
    assert all(r.replica == 1 for r in ll.requests[1:])


def test_simulated_time_is_monotone_across_replicas(hardware):
    fleet = Fleet(hardware, SimHostConfig(), 3, seed=2)
    lm = calibrate(hardware, fleet.engines[0].limits)
    fleet.coserve(CoServing(CoServeConfig(SLO, num_epochs=None), lm, samples(100)))
    run = fleet.replay(trace(120, 0.03))
    for steps in run.replica_steps:
        assert all(a.t_s <= b.t_s for a, b in itertools.pairwise(steps))
        # a replica runs one step at a time: each starts after the previous ended
        assert all(b.t_s - b.seconds >= a.t_s - 1e-9 for a, b in itertools.pairwise(steps))
    assert all(a.at_s <= b.at_s for a, b in itertools.pairwise(run.commits))


def test_standalone_throughput_is_forward_plus_backward(hardware):
    data = samples(50)
    lens = next(standalone.batches(data, 256, seed=0))
    t = (hardware.oracle.step_seconds(SimBatch(ft_lens=lens))
         + hardware.backward.seconds(BackwardJob(lens)))
    assert standalone.step_seconds(hardware, lens) == pytest.approx(t)
    steps = standalone.train(hardware, data, 256, until_s=5.0)
    assert steps and steps[-1].at_s <= 5.0
    rate = sum(s.num_tokens for s in steps) / steps[-1].at_s
    assert rate == pytest.approx(standalone.tokens_per_s(hardware, data, 256), rel=0.1)


def test_a_fleet_trains_until_the_window_closes_however_early_it_drained(hardware):
    fleet = Fleet(hardware, SimHostConfig(), 1, seed=3)
    lm = calibrate(hardware, fleet.engines[0].limits)
    fleet.coserve(CoServing(CoServeConfig(SLO, num_epochs=None), lm, samples(100)))
    run = fleet.replay(trace(10, 0.1), min_end_s=8.0)  # requests over the first second
    drained = max(r.token_times_s[-1] for r in run.requests)
    assert not run.timed_out and all(r.finished for r in run.requests) and drained < 4.0
    # training went on after the last token, up to the window's end
    assert run.end_s >= 8.0 and any(c.at_s > drained + 2.0 for c in run.commits)
    fleet.close()


def test_an_idle_fleet_waits_out_the_window_and_is_not_timed_out(hardware):
    run = Fleet(hardware, SimHostConfig(), 1).replay(trace(5, 0.1), min_end_s=8.0)
    assert run.end_s == 8.0 and not run.timed_out
    assert all(r.finished for r in run.requests)
    # without a window the replay ends at the last token
    bare = Fleet(hardware, SimHostConfig(), 1).replay(trace(5, 0.1))
    assert bare.end_s == max(r.token_times_s[-1] for r in bare.requests) < 8.0
