"""The greedy control: admits to the step limit whatever Δ says."""

import math

import pytest

from deltaserve.bench.greedy import GreedyFixedYieldScheduler, GreedyScheduler
from deltaserve.core import (
    AdmissionConfig,
    AdmissionScheduler,
    BufferLedger,
    SamplePool,
    SchedulingView,
    Skip,
    StepShape,
    WaitingRequest,
)
from deltaserve.core.calibration import HostLimits
from tests.core.test_admission import MODEL, SLO, exact

LENGTHS = (40, 10, 30, 10, 20, 50, 30)
LIMITS = HostLimits(max_tokens_per_step=256, max_seqs_per_step=8, max_model_len=256,
                    max_kv_tokens=10_000)
# a request far past its TTFT objective: Δ < 0, nothing fits Algorithm 1
LATE = SchedulingView(StepShape((100,), num_decode=2, kv_tokens=300), now_s=10.0,
                      waiting=(WaitingRequest(arrival_s=0.0),), oldest_decode_token_s=9.0)


def make(cls, config=None, capacity=1000, limits=LIMITS):
    return cls(config or AdmissionConfig(), SLO, limits, MODEL, SamplePool(list(LENGTHS)),
               BufferLedger(capacity))


def brute_force(room_tokens, room_seqs):
    """Shortest first, whole samples, until the next would break a limit."""
    out = []
    for n in sorted(LENGTHS):
        if sum(out) + n > room_tokens or len(out) + 1 > room_seqs:
            break
        out.append(n)
    return out


def test_algorithm_1_admits_nothing_past_delta_but_greedy_fills_the_step():
    assert make(AdmissionScheduler).plan(LATE).skip is Skip.BUDGET_EXHAUSTED
    plan = make(GreedyScheduler).plan(LATE)
    # step limit 256 tokens less the 102 inference rows, 8 sequences less 3
    want = brute_force(256 - 102, 8 - 3)
    assert list(plan.shape.ft_lens) == want and plan.skip is Skip.STEP_LIMIT
    assert len(plan.samples) == len(want)


def test_greedy_keeps_the_capacity_rules():
    s = make(GreedyScheduler)
    assert s.plan(LATE, backward_running=True).skip is Skip.BACKWARD_RUNNING
    assert not make(GreedyScheduler).plan(LATE, batch_room_tokens=0).samples
    # a sample may start only while the backward batch is short: 10+10+20 reaches 25
    plan = make(GreedyScheduler).plan(LATE, batch_room_tokens=25)
    assert list(plan.shape.ft_lens) == [10, 10, 20] and plan.skip is Skip.BUFFER_FULL
    # the buffer's free run bounds it too
    plan = make(GreedyScheduler, capacity=35).plan(LATE)
    assert list(plan.shape.ft_lens) == [10, 10] and plan.skip is Skip.BUFFER_FULL
    # the per-step fine-tuning cap
    plan = make(GreedyScheduler, AdmissionConfig(max_ft_tokens_per_step=45)).plan(LATE)
    assert list(plan.shape.ft_lens) == brute_force(45, 5)


def test_greedy_prices_its_yields_as_deltaserve_and_fixed_yield_does_not():
    def view(waited_s: float) -> SchedulingView:
        return SchedulingView(StepShape(num_decode=1, kv_tokens=10), now_s=waited_s,
                              oldest_decode_token_s=0.0)

    priced = make(AdmissionScheduler)
    # TPOT 0.1 s less the decode step's exact cost (zero margin): the closed form
    assert priced.yield_budget_s(view(0.0)) == pytest.approx(0.1 - exact(view(0.0).proposed))
    assert priced.yield_budget_s(view(10.0)) < 0  # past the TPOT objective: no slack
    # greedy differs from deltaserve in admission only: its yields are priced the same
    for waited_s in (0.0, 0.05, 10.0):
        assert make(GreedyScheduler).yield_budget_s(view(waited_s)) == \
            priced.yield_budget_s(view(waited_s))
    # greedy-fixed-yield: unbounded whatever the slack (the co-server caps it at max_yield_s)
    assert make(GreedyFixedYieldScheduler).yield_budget_s(view(0.0)) == math.inf
    assert make(GreedyFixedYieldScheduler).yield_budget_s(view(10.0)) == math.inf
    # and it admits as greedy does
    plan = make(GreedyFixedYieldScheduler).plan(LATE)
    assert list(plan.shape.ft_lens) == brute_force(256 - 102, 8 - 3)
