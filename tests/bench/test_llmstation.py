"""The LLMStation baseline's policy, against hand-computed decisions."""

import math

import pytest

from deltaserve.bench.llmstation import LLMStationScheduler
from deltaserve.core import (
    AdmissionConfig,
    BufferLedger,
    SamplePool,
    SchedulingView,
    Skip,
    SLOConfig,
    StepShape,
    WaitingRequest,
)
from tests.core.test_admission import LIMITS, MODEL, exact

SLO = SLOConfig(ttft_s=0.5, tpot_s=0.1)


def make(lengths=(10, 20, 30, 40)):
    return LLMStationScheduler(AdmissionConfig(), SLO, LIMITS, MODEL, SamplePool(list(lengths)),
                               BufferLedger(1000))


def test_prefill_iterations_suspend_fine_tuning():
    s = make()
    plan = s.plan(SchedulingView(StepShape((50,), num_decode=2), 0.0))
    assert plan.skip is Skip.INFERENCE_PRESENT and not plan.samples


def test_decode_iteration_admits_by_profile_within_90_percent_of_tpot():
    s = make()
    plan = s.plan(SchedulingView(StepShape(num_decode=4, kv_tokens=4000), 0.0))
    # profile lookups price (B=4, bucketed tokens) at the profiled context, no margin
    limit = 0.9 * SLO.tpot_s
    assert plan.samples
    toks = plan.num_ft_tokens
    assert s.lookup_s(4, toks) <= limit
    nxt = (10, 20, 30, 40)[len(plan.samples)] if len(plan.samples) < 4 else None
    if nxt is not None:
        assert s.lookup_s(4, toks + nxt) > limit


def test_ignores_ttft_of_queued_requests():
    s = make()
    late = (WaitingRequest(arrival_s=-10.0, tokens_after_step=500),)  # far past its TTFT
    plan = s.plan(SchedulingView(StepShape(num_decode=4), 0.0, waiting=late))
    assert plan.samples  # DeltaServe would admit nothing here


def test_runtime_records_override_the_profile_and_ignore_kv_length():
    s = make()
    s.observe(StepShape(num_decode=4, kv_tokens=100).with_ft((30,)), 0.5)
    assert s.lookup_s(4, 30) == 0.5 and s.lookup_s(4, 20) == 0.5  # same 32-token bucket
    plan = s.plan(SchedulingView(StepShape(num_decode=4, kv_tokens=90_000), 0.0))
    # the cached record (0.5 s > 90 ms) blocks the first bucket whatever the context
    assert not plan.samples and plan.skip is Skip.OVER_BUDGET
    profile = MODEL.predict(StepShape(num_decode=4, kv_tokens=4 * 256, ft_lens=(64,)))
    assert s.lookup_s(4, 64) == pytest.approx(profile)
    assert exact(StepShape(num_decode=4, kv_tokens=4 * 256, ft_lens=(64,))) == pytest.approx(
        profile, rel=1e-6)


def test_idle_iteration_has_no_decode_objective():
    s = make()
    plan = s.plan(SchedulingView(StepShape(), 0.0))
    assert plan.shape.ft_lens == (10, 20, 30, 40) and math.isnan(plan.predicted_s) is False
