"""A host's step records say which steps a yield to the backward preceded, and for how long."""

from __future__ import annotations

import itertools
import random
import time

from deltaserve.core.contract import StepRecord
from deltaserve.core.requests import RequestOutput, SamplingParams
from deltaserve.core.slo import SLOConfig
from deltaserve.hosts.sim.config import SimHostConfig
from deltaserve.hosts.sim.engine import SimEngine
from deltaserve.train.config import BackwardConfig, CoServeConfig, GrantPolicy
from tests.hosts.sim.conftest import samples


def test_each_yield_is_recorded_on_the_step_after_it(hardware):
    eng = SimEngine(SimHostConfig(noise=False), hardware=hardware, seed=3)
    steps: list[StepRecord] = []
    eng.subscribe_steps(steps.append)
    co = eng.attach(dataset=samples(300), config=CoServeConfig(
        SLOConfig(0.4, 0.12), num_epochs=None,
        backward=BackwardConfig(grant_policy=GrantPolicy.EXCLUSIVE)))
    rng, t = random.Random(0), 0.0
    outs: dict[str, RequestOutput] = {}
    for i in range(30):
        t += rng.expovariate(4.0)
        prompt, out = rng.randint(16, 3000), rng.randint(1, 300)
        eng.clock.at(t, lambda i=i, p=prompt, o=out: eng.add_request(
            [0] * p, SamplingParams(max_tokens=o, ignore_eos=True), request_id=f"q{i}",
            callback=lambda r: outs.__setitem__(r.request_id, r)))
    eng.kick()
    eng.clock.run(until=lambda: len(outs) == 30 and all(
        o.finished for o in outs.values()))
    assert len(outs) == 30
    yielded = [s for s in steps if s.yielded_s > 0]
    assert yielded and len(yielded) == co.trainer.counts["yields"]
    # on the simulated clock a step starts when its yield ends, or earlier at an arrival (the
    # record holds the time promised): the gap before it is the yield or a part of it
    gaps = [(b.t_s - b.seconds - a.t_s, b.yielded_s) for a, b in itertools.pairwise(steps)
            if b.yielded_s > 0]
    assert all(0 < gap <= lent + 1e-9 for gap, lent in gaps)
    assert sum(abs(gap - lent) < 1e-9 for gap, lent in gaps) > len(gaps) / 2
    assert all(s.yielded_s == 0 for s in steps if not s.shape.has_inference)


def test_each_step_records_the_time_the_co_servers_hooks_held_the_host(hardware, monkeypatch):
    eng = SimEngine(SimHostConfig(noise=False), hardware=hardware, seed=3)
    steps: list[StepRecord] = []
    eng.subscribe_steps(steps.append)
    co = eng.attach(dataset=samples(300), config=CoServeConfig(SLOConfig(0.4, 0.12),
                                                               num_epochs=None))
    plan_s, observe_s = 0.004, 0.002  # wall seconds each hook is made to take
    real_plan, real_observe = co.scheduler.plan, co.scheduler.observe

    def slow_plan(*a, **kw):
        time.sleep(plan_s)
        return real_plan(*a, **kw)

    def slow_observe(*a, **kw):
        time.sleep(observe_s)
        return real_observe(*a, **kw)

    monkeypatch.setattr(co.scheduler, "plan", slow_plan)
    monkeypatch.setattr(co.scheduler, "observe", slow_observe)
    outs: dict[str, RequestOutput] = {}
    for i in range(3):
        eng.add_request([0] * 64, SamplingParams(max_tokens=4, ignore_eos=True),
                        request_id=f"q{i}", callback=lambda r: outs.__setitem__(r.request_id, r))
    eng.kick()
    eng.clock.run(until=lambda: len(outs) == 3 and all(o.finished for o in outs.values()))
    timed = [s for s in steps if not s.shape.is_empty]
    assert len(timed) >= 4
    # the first step's record holds its plan; every later one also the observe before it
    assert timed[0].hooks_s >= plan_s
    assert all(s.hooks_s >= plan_s + observe_s for s in timed[1:])
