import dataclasses
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve.core import (
    AdmissionConfig,
    AdmissionMode,
    AdmissionScheduler,
    Batching,
    BufferLedger,
    HostLimits,
    InputError,
    SamplePool,
    SchedulingView,
    Skip,
    SLOConfig,
    StepShape,
    WaitingRequest,
)
from deltaserve.core.latency_model import LatencyModelConfig, fit_from
from deltaserve.core.slo import Lookahead

# A model fitted exactly (no noise, zero margin): T = 1e-6 Σn² + 1e-3 (T_in+B_d) + 2e-3 T_ft + c
ALPHA, BETA, GAMMA, C = 1e-6, 1e-3, 2e-3, 0.010
DEC_BETA, DEC_C = 5e-4, 0.005


def exact(s: StepShape) -> float:
    if s.is_decode_only:
        return DEC_BETA * s.num_decode + DEC_C
    return (ALPHA * s.prefill_sq_tokens + BETA * (s.num_prefill_tokens + s.num_decode)
            + GAMMA * s.num_ft_tokens + C)


SHAPES = [StepShape((n,)) for n in (10, 50, 100, 300, 700)] + [
    StepShape((n, m)) for n, m in ((100, 100), (300, 20), (50, 400))] + [
    StepShape((n,), num_decode=b).with_ft(f) for n, b, f in
    ((10, 2, (30,)), (100, 0, (50, 60)), (40, 8, (200,)), (200, 4, (10, 10, 10)))] + [
    StepShape(ft_lens=f) for f in ((100,), (300, 20))] + [
    StepShape(num_decode=b) for b in (1, 2, 4, 8, 16, 32, 64)]
MODEL = fit_from([(s, exact(s)) for s in SHAPES], LatencyModelConfig(margin_floor=0.0))
# the same host, but its inference rows cost 0.5 ms more each once training rows ride along (ζ)
MODEL_ZETA = fit_from([(s, exact(s) + (5e-4 * (s.num_prefill_tokens + s.num_decode)
                                       if s.ft_lens else 0.0)) for s in SHAPES],
                      LatencyModelConfig(margin_floor=0.0))
# the same exact fit, with a 25 % safety margin: admission must price every step inflated
MODEL_MARGIN = fit_from([(s, exact(s)) for s in SHAPES], LatencyModelConfig(margin_floor=0.25))
SLO = SLOConfig(ttft_s=0.5, tpot_s=0.1)
LIMITS = HostLimits(max_tokens_per_step=2048, max_seqs_per_step=64, max_model_len=1024,
                    max_kv_tokens=100_000)


def make(lengths=(10, 20, 30, 40), capacity=1000, config=None, limits=LIMITS, model=MODEL):
    pool = SamplePool(list(lengths))
    ledger = BufferLedger(capacity)
    sched = AdmissionScheduler(config or AdmissionConfig(), SLO, limits, model, pool, ledger)
    return sched, pool, ledger


def view(proposed=StepShape(), **kw):
    return SchedulingView(proposed=proposed, now_s=kw.pop("now_s", 100.0), **kw)


def test_model_is_exact():
    assert MODEL.predict_upper(StepShape((123,), num_decode=5).with_ft((77,))) == pytest.approx(
        exact(StepShape((123,), num_decode=5).with_ft((77,))), rel=1e-6)


def test_idle_step_fills_with_shortest_samples_up_to_step_cap():
    sched, pool, ledger = make(config=AdmissionConfig(max_ft_tokens_per_step=65))
    plan = sched.plan(view())
    assert [s.num_tokens for s in plan.samples] == [10, 20, 30]
    assert plan.skip is Skip.STEP_LIMIT
    assert plan.shape.ft_lens == (10, 20, 30) and not plan.shape.has_inference
    assert len(pool) == 1 and ledger.used_tokens == 60
    assert [s.rows.start for s in plan.samples] == [0, 10, 30]


def test_greedy_stops_at_first_sample_that_violates_delta():
    # one waiting request with 0.2 s of TTFT slack left; prefill of 100 tokens in the step
    sched, _pool, _ = make(lengths=(10, 20, 30, 40, 5000 // 100))
    v = view(StepShape((100,)), waiting=(WaitingRequest(arrival_s=99.7),))
    base = exact(StepShape((100,)))
    plan = sched.plan(v)
    assert plan.budget.delta_s == pytest.approx(0.2)
    chosen = plan.shape.ft_lens
    assert exact(plan.shape) <= 0.2
    # the next sample in length order would have crossed Δ
    nxt = sorted((10, 20, 30, 40, 50))[len(chosen)]
    assert exact(StepShape((100,)).with_ft((*chosen, nxt))) > 0.2
    assert plan.skip is Skip.OVER_BUDGET and base < 0.2
    assert plan.predicted_s == pytest.approx(exact(plan.shape), rel=1e-6)


def test_a_reserve_leaves_delta_unspent_as_a_step_that_starts_later_would():
    # a step with 0.2 s of TTFT slack that must keep 0.08 s of it admits exactly what the same
    # step planned 0.08 s later (0.12 s of slack) admits
    lengths = (10, 20, 30, 40, 50, 60)
    waiting = (WaitingRequest(arrival_s=99.7),)
    kept = make(lengths=lengths)[0].plan(view(StepShape((100,)), waiting=waiting),
                                         reserve_s=0.08)
    later = make(lengths=lengths)[0].plan(view(StepShape((100,)), now_s=100.08,
                                               waiting=waiting))
    assert kept.shape.ft_lens == later.shape.ft_lens and kept.skip is Skip.OVER_BUDGET
    assert exact(kept.shape) <= 0.12 < exact(StepShape((100,)).with_ft(
        (*kept.shape.ft_lens, lengths[len(kept.shape.ft_lens)])))
    unreserved = make(lengths=lengths)[0].plan(view(StepShape((100,)), waiting=waiting))
    assert len(unreserved.shape.ft_lens) > len(kept.shape.ft_lens)


def test_budget_exhausted_by_inference_only_batch():
    sched, pool, ledger = make()
    big = StepShape((700,))  # 0.49 + 0.7 + 0.01 s > 0.5 - 0.1 s slack
    plan = sched.plan(view(big, waiting=(WaitingRequest(arrival_s=99.9),)))
    assert plan.skip is Skip.BUDGET_EXHAUSTED and plan.samples == ()
    assert plan.shape == big and len(pool) == 4 and ledger.used_tokens == 0


def test_tpot_bounds_a_mixed_host():
    sched, _, _ = make()
    v = view(StepShape(num_decode=4), oldest_decode_token_s=99.95)  # 0.05 s of TPOT slack
    plan = sched.plan(v)
    assert plan.budget.tpot_slack_s == pytest.approx(0.05)
    assert exact(plan.shape) <= 0.05 and plan.samples


def test_phase_separated_host():
    limits = HostLimits(2048, 64, 1024, 100_000, Batching.PHASE_SEPARATED)
    sched, _pool, _ = make(limits=limits)
    assert sched.plan(view(StepShape(num_decode=8))).skip is Skip.DECODE_ONLY_STEP
    # a prefill step defers the decode step that follows it: its cost comes off the TPOT slack
    deferred = StepShape(num_decode=8)
    v = view(StepShape((50,)), oldest_decode_token_s=99.995, deferred_decode=deferred)
    plan = sched.plan(v)
    assert plan.budget.tpot_slack_s == pytest.approx(0.1 - 0.005 - exact(deferred))
    assert plan.samples and exact(plan.shape) <= plan.budget.delta_s
    # prompts queued behind this step run before that decode step too (prefill first)
    rate = exact(StepShape((2048,))) / 2048
    queued = (WaitingRequest(99.99, 0), WaitingRequest(99.99, 300), WaitingRequest(99.99, 700))
    v = view(StepShape((50,)), oldest_decode_token_s=99.995, deferred_decode=deferred,
             waiting=queued)
    assert sched.budget(v).tpot_slack_s == pytest.approx(0.1 - 0.005 - exact(deferred)
                                                         - 700 * rate)
    # every step the deferred decode still waits through may end late: one prefill step of
    # at most 2048 tokens for 700 queued tokens, and the decode step, each keep the lateness back
    late_s = 0.002
    assert sched.budget(v, ahead=Lookahead(late_s)).tpot_slack_s == pytest.approx(
        0.1 - 0.005 - exact(deferred) - 700 * rate - 1 * late_s - 1 * late_s)
    many = (*queued, WaitingRequest(99.99, 5000))
    v = view(StepShape((50,)), oldest_decode_token_s=99.995, deferred_decode=deferred,
             waiting=many)
    assert sched.budget(v, ahead=Lookahead(late_s)).tpot_slack_s == pytest.approx(
        0.1 - 0.005 - exact(deferred) - 5000 * rate - 3 * late_s - 1 * late_s)
    # prompts arriving at 20 tokens/s take rate * 20 of the host's time until that decode step
    # runs, each before it: that share of what the objective leaves is kept back
    rho = rate * 20
    assert sched.budget(v, ahead=Lookahead(0.0, 20.0)).tpot_slack_s == pytest.approx(
        (0.1 - 0.005) * (1 - rho) - exact(deferred) - 5000 * rate)
    # arrivals as fast as the host prefills leave no slack, and no admission
    flood = Lookahead(0.0, 2.0 / rate)
    assert sched.budget(v, ahead=flood).tpot_slack_s < 0
    assert sched.plan(v, ahead=flood).skip is Skip.BUDGET_EXHAUSTED


def test_arrivals_do_not_touch_a_mixed_host():
    # a mixed-batching host runs its decodes in every step: arrivals delay no decode step
    sched, _, _ = make()
    v = view(StepShape((50,), num_decode=4), oldest_decode_token_s=99.95)
    assert sched.budget(v, ahead=Lookahead(0.0, 1e6)) == sched.budget(v)


@pytest.mark.parametrize("setup,skip", [
    ("backward", Skip.BACKWARD_RUNNING), ("full", Skip.BUFFER_FULL), ("empty", Skip.POOL_EMPTY),
    ("off", Skip.OFF),
])
def test_no_admission_cases(setup, skip):
    cfg = AdmissionConfig(mode=AdmissionMode.OFF) if setup == "off" else None
    sched, pool, ledger = make(capacity=15 if setup == "full" else 1000, config=cfg)
    if setup == "full":
        ledger.reserve(999, 6)  # 9 free rows < shortest sample (10)
    if setup == "empty":
        pool.claim([0, 1, 2, 3])
    plan = sched.plan(view(), backward_running=setup == "backward")
    assert plan.skip is skip and plan.samples == ()


def test_admit_during_backward_ablation():
    sched, _, _ = make(config=AdmissionConfig(admit_during_backward=True))
    assert sched.plan(view(), backward_running=True).samples


def test_temp_mode_only_in_steps_without_inference():
    sched, _, _ = make(config=AdmissionConfig(mode=AdmissionMode.TEMP))
    assert sched.plan(view(StepShape(num_decode=1))).skip is Skip.INFERENCE_PRESENT
    assert sched.plan(view(StepShape((5,)))).skip is Skip.INFERENCE_PRESENT
    plan = sched.plan(view())
    assert plan.shape.ft_lens == (10, 20, 30, 40)


def test_buffer_room_limits_admission():
    sched, _pool, _ledger = make(capacity=35)
    plan = sched.plan(view())
    assert plan.shape.ft_lens == (10, 20) and plan.skip is Skip.BUFFER_FULL
    assert sched.plan(view()).skip is Skip.BUFFER_FULL  # 5 rows left < 30


def test_nothing_is_picked_twice():
    sched, _pool, ledger = make(lengths=[7] * 50, config=AdmissionConfig(max_ft_tokens_per_step=30))
    seen = []
    while True:
        plan = sched.plan(view())
        if not plan.samples:
            break
        seen += [s.sample_id for s in plan.samples]
    assert sorted(seen) == list(range(50)) or ledger.free_tokens < 7
    assert len(seen) == len(set(seen))


def test_uncalibrated_model_admits_nothing():
    from deltaserve.core import LatencyModel

    pool, ledger = SamplePool([3]), BufferLedger(10)
    sched = AdmissionScheduler(AdmissionConfig(), SLO, LIMITS, LatencyModel(), pool, ledger)
    assert sched.plan(view()).skip is Skip.UNCALIBRATED


def test_queue_wait_tightens_ttft():
    sched, _, _ = make()
    rate = sched.queue_s_per_token(StepShape((100,)))
    assert rate == pytest.approx(exact(StepShape((2048,))) / 2048, rel=1e-6)
    v = view(StepShape((100,)), waiting=(WaitingRequest(99.9, 0), WaitingRequest(99.95, 500)))
    assert sched.budget(v).ttft_slack_s == pytest.approx(0.5 - 0.05 - 500 * rate)
    assert math.isinf(sched.budget(view()).delta_s)


def test_queue_wait_counts_the_decodes_riding_in_each_step():
    # a mixed host: 48 decodes take 48 of each step's 2048 tokens and their share of its time
    sched, _, _ = make()
    proposed = StepShape((100,), num_decode=48, kv_tokens=5000)
    rate = sched.queue_s_per_token(proposed)
    assert rate == pytest.approx(exact(StepShape((2000,), num_decode=48)) / 2000, rel=1e-6)
    # a phase-separated host runs its prefills alone: the decodes do not slow the queue
    separated = dataclasses.replace(LIMITS, batching=Batching.PHASE_SEPARATED)
    sched, _, _ = make(limits=separated)
    assert sched.queue_s_per_token(proposed) == pytest.approx(exact(StepShape((2048,))) / 2048,
                                                              rel=1e-6)


def test_config_validation():
    with pytest.raises(InputError) as e:
        AdmissionConfig(mode="sometimes")
    assert e.value.field == "mode"
    with pytest.raises(InputError):
        AdmissionConfig(max_ft_tokens_per_step=0)
    for bad in (0.0, -0.5, 1.5, math.nan):
        with pytest.raises(InputError) as e:
            AdmissionConfig(tpot_slack_spend_fraction=bad)
        assert e.value.field == "tpot_slack_spend_fraction"


def test_margin_inflates_every_admitted_step():
    # 25 % margin: the plan's step, inflated, stays within Δ; the exact (uninflated) cost of
    # one more sample would still have fit, so a planner that dropped the margin admits more
    sched, _, _ = make(lengths=(2,) * 40, model=MODEL_MARGIN)
    v = view(StepShape(num_decode=4), oldest_decode_token_s=99.99)  # 0.09 s of TPOT slack
    plan = sched.plan(v)
    assert plan.samples and plan.skip is Skip.OVER_BUDGET
    assert 1.25 * exact(plan.shape) <= 0.09 < 1.25 * exact(plan.shape.with_ft((2,)))
    assert exact(plan.shape.with_ft((2,))) <= 0.09
    assert plan.predicted_s == pytest.approx(1.25 * exact(plan.shape), rel=1e-6)


@pytest.mark.parametrize("proposed", [StepShape((20,), num_decode=4), StepShape(num_decode=4)])
@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.2])
def test_tpot_slack_spend_fraction_bounds_the_step_in_closed_form(fraction, proposed):
    # 4 decodes whose oldest token is 0.01 s old: 0.09 s of TPOT slack. With fraction f the
    # step may cost the prediction of the step without training plus f of the slack beyond
    # it, no more (a decode-only step is priced by its own equation without training)
    lengths = (2,) * 60
    sched, _, _ = make(lengths=lengths,
                       config=AdmissionConfig(tpot_slack_spend_fraction=fraction))
    v = view(proposed, oldest_decode_token_s=99.99)
    base, slack = exact(proposed), 0.09
    bound = base + fraction * (slack - base)
    assert sched.yield_budget_s(v) == pytest.approx(fraction * (slack - base), rel=1e-6)
    plan = sched.plan(v)
    assert plan.samples and plan.skip is Skip.OVER_BUDGET
    assert exact(plan.shape) <= bound + 1e-12 < exact(plan.shape.with_ft((2,)))
    # TTFT slack is not scaled: a prefill step bound by TTFT admits as with fraction 1
    waiting = (WaitingRequest(arrival_s=99.7),)
    full = make(lengths=lengths)[0].plan(view(StepShape((100,)), waiting=waiting))
    part = sched.plan(view(StepShape((100,)), waiting=waiting))
    assert part.shape.ft_lens == full.shape.ft_lens


def test_batch_room_lets_only_the_last_sample_overshoot():
    sched, pool, _ = make(lengths=(10, 20, 30, 40))
    plan = sched.plan(view(), batch_room_tokens=25)
    assert plan.shape.ft_lens == (10, 20) and plan.skip is Skip.BUFFER_FULL  # 30 >= 25: stop
    assert sched.plan(view(), batch_room_tokens=0).skip is Skip.BUFFER_FULL
    assert len(pool) == 2


def reference_greedy(sched, proposed, delta, batch_room):
    """Algorithm 1's inner loop one sample at a time (the definition the planner's closed form
    per run of equal lengths must reproduce)."""
    room_tokens = min(sched.limits.max_tokens_per_step - proposed.num_tokens,
                      sched.config.max_ft_tokens_per_step, sched.ledger.largest_free_run)
    room_seqs = sched.limits.max_seqs_per_step - proposed.num_seqs
    lens, stop = [], Skip.POOL_EMPTY
    for _, n in sched.pool.iter_available():
        tok = sum(lens)
        if tok >= batch_room:
            stop = Skip.BUFFER_FULL
            break
        if tok + n > room_tokens or len(lens) >= room_seqs:
            stop = (Skip.BUFFER_FULL if tok + n > sched.ledger.largest_free_run
                    else Skip.STEP_LIMIT)
            break
        if sched.model.predict_upper(proposed.with_ft((*lens, n))) > delta:
            stop = Skip.OVER_BUDGET
            break
        lens.append(n)
    return tuple(lens), stop


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=80),
       prefill=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 600)), max_size=3),
       num_decode=st.integers(0, 20),
       waited_s=st.floats(0.0, 0.45), capacity=st.integers(1, 2000),
       cap=st.integers(1, 3000), seqs=st.integers(1, 64),
       batch_room=st.one_of(st.none(), st.integers(1, 500)),
       model=st.sampled_from([MODEL, MODEL_ZETA, MODEL_MARGIN]))
def test_plan_equals_per_sample_greedy(lengths, prefill, num_decode, waited_s, capacity, cap,
                                       seqs, batch_room, model):
    limits = HostLimits(max_tokens_per_step=2048, max_seqs_per_step=64 + seqs,
                        max_model_len=1024, max_kv_tokens=100_000)
    sched, pool, ledger = make(lengths, capacity, AdmissionConfig(max_ft_tokens_per_step=cap),
                               limits, model)
    # each prefill chunk may sit behind a cached prefix (a chunked-prefill continuation)
    chunks = tuple(n for n, _ in prefill)
    prefixes = tuple(p for _, p in prefill)
    proposed = StepShape(chunks, num_decode=num_decode,
                         kv_tokens=10 * num_decode + sum(prefixes),
                         prefill_prefix_lens=prefixes if any(prefixes) else ())
    waiting = (WaitingRequest(100.0 - waited_s, 0),) if prefill else ()
    v = view(proposed, waiting=waiting, oldest_decode_token_s=99.95 if num_decode else None)
    order = [sid for sid, _ in pool.iter_available()]
    delta = sched.budget(v).delta_s
    want_lens, want_stop = reference_greedy(sched, proposed, delta,
                                            math.inf if batch_room is None else batch_room)
    plan = sched.plan(v, batch_room_tokens=batch_room)
    if proposed.prefill_lens and plan.budget is not None:  # past the pre-checks, a batch
        # with prefill is priced by eager Equation I alone as with samples: the oracle's
        exhausted = model.predict_upper(proposed) > delta
        assert (plan.skip is Skip.BUDGET_EXHAUSTED) == exhausted
    if plan.skip is Skip.BUDGET_EXHAUSTED:  # the inference batch alone is over Δ
        assert not want_lens
        return
    assert plan.shape.ft_lens == want_lens
    assert [s.sample_id for s in plan.samples] == order[:len(want_lens)]
    assert plan.skip is want_stop
    if want_lens:
        assert plan.predicted_s == pytest.approx(model.predict_upper(plan.shape), rel=1e-9)
        spans = [s.rows for s in plan.samples]
        assert all(a.stop == b.start for a, b in itertools.pairwise(spans))
        assert ledger.used_tokens == sum(want_lens)
