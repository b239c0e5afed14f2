"""The simulated host: the real scheduler and co-server on a simulated clock conserve requests,
tokens and samples; an arrival cuts a training-only step at a layer boundary; time never runs
backward."""

from __future__ import annotations

import itertools
import math
import random
import time

import pytest

from deltaserve.bench.llmstation import LLMStationScheduler
from deltaserve.core.contract import StepRecord
from deltaserve.core.requests import RequestOutput, SamplingParams
from deltaserve.core.slo import SLOConfig
from deltaserve.hosts.sim.config import SimHostConfig
from deltaserve.hosts.sim.engine import SimEngine
from deltaserve.train.config import BackwardConfig, CoServeConfig, GrantPolicy
from deltaserve.train.events import OptimizerStep
from tests.hosts.sim.conftest import samples

SLO = SLOConfig(0.4, 0.12)


def engine(hardware, **kw) -> tuple[SimEngine, list[StepRecord]]:
    eng = SimEngine(SimHostConfig(**kw), hardware=hardware, seed=3)
    steps: list[StepRecord] = []
    eng.subscribe_steps(steps.append)
    return eng, steps


def send(eng: SimEngine, n: int, rate_rps: float, seed: int = 0) -> dict[str, RequestOutput]:
    """``n`` requests at Poisson times; returns their outputs once finished."""
    rng, outs, t = random.Random(seed), {}, 0.0
    for i in range(n):
        t += rng.expovariate(rate_rps)
        prompt, out = rng.randint(16, 3000), rng.randint(1, 300)
        eng.clock.at(t, lambda i=i, p=prompt, o=out: eng.add_request(
            [0] * p, SamplingParams(max_tokens=o, ignore_eos=True), request_id=f"q{i}",
            callback=lambda r: outs.__setitem__(r.request_id, r)))
    return outs


def test_requests_and_tokens_are_conserved(hardware):
    eng, steps = engine(hardware)
    outs = send(eng, 120, rate_rps=20)
    eng.clock.run()
    asked = {f"q{i}": p for i, p in enumerate(_params(120))}
    assert set(outs) == set(asked) and all(o.finished for o in outs.values())
    for rid, o in outs.items():
        prompt, out = asked[rid]
        assert len(o.prompt_token_ids) == prompt and len(o.output_token_ids) == out
    prefill = sum(sum(s.shape.prefill_lens) for s in steps)
    decode = sum(s.shape.num_decode for s in steps)
    assert prefill == sum(p for p, _ in asked.values())  # no preemption: the KV cache is ample
    assert decode == sum(o - 1 for _, o in asked.values())


def _params(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        rng.expovariate(1.0)
        out.append((rng.randint(16, 3000), rng.randint(1, 300)))
    return out


def test_coserving_conserves_samples_and_never_runs_time_backward(hardware):
    eng, steps = engine(hardware)
    data = samples(300)
    co = eng.attach(dataset=data, config=CoServeConfig(SLO, num_epochs=None))
    commits: list[OptimizerStep] = []
    co.subscribe(lambda ev: commits.append(ev) if isinstance(ev, OptimizerStep) else None)
    outs = send(eng, 150, rate_rps=10)
    eng.kick()
    eng.clock.run(until=lambda: len(outs) == 150 and all(o.finished for o in outs.values()))
    # inference is untouched by co-serving: every request gets exactly its tokens
    assert all(len(o.output_token_ids) == p[1] for o, p in zip(
        (outs[f"q{i}"] for i in range(150)), _params(150), strict=True))
    forwarded = sum(s.ft_tokens for s in steps if not s.aborted)
    committed = sum(c.num_tokens for c in commits)
    assert committed > 0 and committed <= forwarded
    eng.detach(drain=True)  # trains what was captured
    p = co.book.progress()
    assert p.samples_claimed == 0
    assert p.tokens_committed_total == sum(c.num_tokens for c in commits) == forwarded
    trained = [(c.epoch, i) for c in commits for i in c.sample_ids]
    assert len(trained) == len(set(trained))  # once per epoch
    for epoch in range(p.epoch):  # finished epochs trained every sample
        assert {i for e, i in trained if e == epoch} == set(range(len(data)))
    # one clock stamps everything: steps, tokens and optimizer steps never go back in time
    for seq in ([s.t_s for s in steps], [c.at_s for c in commits],
                *[o.token_times_s for o in outs.values()]):
        assert all(a <= b for a, b in itertools.pairwise(seq))
    assert all(o.token_times_s[0] >= o.arrival_s for o in outs.values())


def test_an_arrival_cuts_a_training_only_step_at_the_next_layer_boundary(hardware):
    eng, steps = engine(hardware, noise=False)
    eng.attach(dataset=samples(200, low=200, high=400), config=CoServeConfig(SLO))
    eng.kick()  # idle with samples: a training-only step starts at t=0
    first = eng._running
    assert first is not None and first.step is not None and first.step.abortable
    layer_s = first.seconds / first.num_layers
    arrive = 4.3 * layer_s
    eng.clock.at(arrive, lambda: eng.add_request([0] * 10, SamplingParams(max_tokens=2)))
    eng.clock.run(until=lambda: bool(steps))
    cut = steps[0]
    assert cut.aborted and cut.ft_tokens == first.step.rows.num_tokens
    assert cut.seconds == pytest.approx(5 * layer_s)  # layer 5's boundary follows the arrival
    assert cut.t_s == pytest.approx(5 * layer_s)
    # its samples went back to the pool: only the next step's (the request's prefill, with
    # what admission let ride beside it) are claimed
    nxt = eng._running
    assert nxt is not None and nxt.shape.prefill_lens == (10,)
    assert eng._co.book.progress().samples_claimed == nxt.step.rows.num_samples


def test_without_interruption_the_training_step_runs_whole(hardware):
    eng, steps = engine(hardware, noise=False)
    eng.attach(dataset=samples(200, low=200, high=400),
               config=CoServeConfig(SLO, interrupt=False))
    eng.kick()
    first = eng._running
    eng.clock.at(0.1 * first.seconds, lambda: eng.add_request([0] * 10,
                                                             SamplingParams(max_tokens=2)))
    eng.clock.run(until=lambda: bool(steps))
    assert not steps[0].aborted and math.isclose(steps[0].seconds, first.seconds)


def test_nothing_on_the_simulated_path_reads_the_wall_clock(hardware, monkeypatch):
    """Every time the control plane reads comes from the simulated clock: with the process's
    monotonic clock made to fail, a co-served replay still runs."""
    eng, steps = engine(hardware)
    eng.attach(dataset=samples(100), config=CoServeConfig(SLO, num_epochs=None))

    def wall_clock() -> float:
        raise AssertionError("the simulated path read time.monotonic()")

    monkeypatch.setattr(time, "monotonic", wall_clock)
    outs = send(eng, 40, rate_rps=10)
    eng.kick()
    eng.clock.run(until=lambda: len(outs) == 40 and all(o.finished for o in outs.values()))
    assert any(s.ft_tokens for s in steps) and any(s.shape.num_decode for s in steps)


def test_a_time_sliced_backward_gets_the_lent_time_before_a_decode_step(hardware):
    """LLMStation's design: the host lends the device before a decode step for what its
    lookup prices, and the backward computes only then (and in idle time)."""
    eng, steps = engine(hardware, noise=False)
    co = eng.attach(dataset=samples(300), config=CoServeConfig(
        SLO, num_epochs=None, backward=BackwardConfig(grant_policy=GrantPolicy.EXCLUSIVE)),
        scheduler_cls=LLMStationScheduler)
    outs = send(eng, 30, rate_rps=4)
    eng.kick()
    eng.clock.run(until=lambda: len(outs) == 30 and all(o.finished for o in outs.values()))
    assert co.trainer.counts["yields"] > 0
    # a yield delays the step after it: the gap before a decode step exceeds the step itself
    gaps = [b.t_s - a.t_s - b.seconds for a, b in itertools.pairwise(steps)
            if b.shape.is_decode_only]
    assert max(gaps) > 0.005
    # the lent slots are what LLMStation's lookup leaves of 0.9 × TPOT: none is longer
    assert max(gaps) <= 0.9 * SLO.tpot_s
    assert co.stats().ft_tokens_committed > 0
