"""The facade's yield to the backward keeps what late steps need: a closed form over the
admission scheduler's slack, with a stand-in trainer (no backward process)."""

import copy
import dataclasses
import threading
from collections import Counter
from dataclasses import dataclass

import pytest

from deltaserve.core import SchedulingView, StepShape
from deltaserve.core.admission import AdmissionPlan, AdmissionScheduler
from deltaserve.core.calibration import Batching
from deltaserve.core.contract import StepReport, TrainingRows
from deltaserve.core.data import TrainingSample
from deltaserve.core.slo import Lookahead, WaitingRequest
from deltaserve.core.yield_reserve import YieldReserveConfig
from deltaserve.train.config import BackwardConfig, CoServeConfig, GrantPolicy
from deltaserve.train.facade import CoServer
from tests.core.test_admission import LIMITS, MODEL, SLO

LAYER_S = 0.001
DECODE = StepShape(num_decode=2, kv_tokens=40)


@dataclass(frozen=True)
class StandInStep:
    plan: AdmissionPlan
    rows: TrainingRows
    abortable: bool = False
    saves_mlp: bool = False


class StandInTrainer:
    has_pending = False
    optimizer_steps = 0
    last_loss = None
    backward_busy_s = 0.0
    # the grant: a backward always in flight, exclusive, yielding at every layer
    backward_busy = True
    backward_exclusive = True
    backward_layer_s = LAYER_S

    def __init__(self, config, book):
        self.config, self.counts = config, Counter()

    @property
    def steps_lost(self) -> dict[str, int]:
        return {}

    def before_step(self, shape: StepShape) -> None:
        pass

    def after_step(self) -> None:
        pass

    def release_backward(self) -> None:
        pass

    def lend(self, seconds: float, wake: threading.Event) -> float:
        return seconds

    def step(self, plan, rows, abortable, abort):
        return StandInStep(plan, rows)

    def poll(self, timeout_s: float = 0.0) -> None:
        pass

    def maybe_launch(self, force: bool = False) -> None:
        pass

    def subscribe(self, listener) -> None:
        pass  # emits no training events


class Clock:
    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class RecordingScheduler(AdmissionScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reserves: list[float] = []

    def plan(self, view, **kwargs):
        self.reserves.append(kwargs["reserve_s"])
        return super().plan(view, **kwargs)


def coserver(quantile=1.0, min_steps=4, max_yield_s=10.0, limits=LIMITS):
    # every slack the reserve leaves is spent: these tests check the reserve's arithmetic
    reserve = YieldReserveConfig(quantile=quantile, window=64, min_steps=min_steps,
                                 spend_fraction=1.0)
    config = CoServeConfig(slo=SLO, backward=BackwardConfig(
        grant_policy=GrantPolicy.EXCLUSIVE, threads=1, max_yield_s=max_yield_s,
        yield_reserve=reserve))
    samples = [TrainingSample(0, (1, 2, 3), (1, 2, 3))]
    return CoServer(config, limits, samples, StandInTrainer,
                        latency_model=copy.deepcopy(MODEL),  # it learns from the steps
                        scheduler_cls=RecordingScheduler, clock=Clock())


def run_step(co: CoServer, seconds_past_prediction: float, waited_s: float = 0.0,
             planned_at_s: float = 0.0) -> None:
    """A step planned at ``planned_at_s`` that waited ``waited_s`` (for the backward to stop,
    the co-server's own bookkeeping) besides its forward, and ended ``seconds_past_prediction``
    after its prediction."""
    co._clock.now_s = planned_at_s
    step = co.plan(SchedulingView(DECODE, now_s=0.0, oldest_decode_token_s=0.0))
    predicted_s = co.latency.predict_upper(DECODE)
    co._clock.now_s = planned_at_s + predicted_s + seconds_past_prediction
    co.observe(StepReport(step, DECODE, predicted_s + seconds_past_prediction - waited_s))


def view() -> SchedulingView:
    return SchedulingView(DECODE, now_s=0.0, oldest_decode_token_s=0.0)


def test_no_yield_until_steps_were_seen():
    co = coserver(min_steps=4)
    assert co.scheduler.yield_budget_s(view()) > 0.05  # the SLOs leave room
    for _ in range(3):
        run_step(co, 0.0)
        assert co.yield_budget_s(view()) == 0.0


def test_yield_leaves_the_latest_lateness_counted_from_planning():
    co = coserver(quantile=1.0)
    for late in (0.004, 0.010, -0.003, 0.006):
        run_step(co, late)
    slack = co.scheduler.yield_budget_s(view())  # after the model learnt from the steps
    assert slack > 0.05
    assert co.yield_budget_s(view()) == pytest.approx(slack - 0.010)
    # a step that waited 15 ms for the backward's layer boundary: the forward alone was on time
    run_step(co, 0.015, waited_s=0.015)
    slack = co.scheduler.yield_budget_s(view())
    assert co.yield_budget_s(view()) == pytest.approx(slack - 0.015)


def test_a_yield_that_overran_counts_against_the_step_after_it():
    co = coserver(quantile=1.0)
    for _ in range(4):
        run_step(co, 0.0)
    co.yield_budget_s(view())  # priced before the yield, as plan_after_yield does
    co._clock.now_s = 1.0
    co.yield_to_backward(0.05, threading.Event())
    run_step(co, 0.0, planned_at_s=1.07)  # the host got the machine back 20 ms late
    slack = co.scheduler.yield_budget_s(view())
    assert co.yield_budget_s(view()) == pytest.approx(slack - 0.02)
    run_step(co, 0.0)  # counted once
    for _ in range(63):
        run_step(co, 0.0)  # the window (64) forgets it
    slack = co.scheduler.yield_budget_s(view())
    assert co.yield_budget_s(view()) == pytest.approx(slack - 2 * LAYER_S)


def test_yield_keeps_two_layers_when_steps_run_early():
    co = coserver()
    for _ in range(4):
        run_step(co, -0.004)  # 4 ms early (the prediction is 6 ms)
    slack = co.scheduler.yield_budget_s(view())
    assert co.yield_budget_s(view()) == pytest.approx(slack - 2 * LAYER_S)


def test_yield_is_capped_and_none_without_room():
    co = coserver(max_yield_s=0.01)
    for _ in range(4):
        run_step(co, 0.0)
    assert co.yield_budget_s(view()) == 0.01
    co = coserver()
    for _ in range(4):
        run_step(co, 1.0)  # steps a second late, more than the whole slack: nothing to lend
    assert 0 < co.scheduler.yield_budget_s(view()) < 1.0
    assert co.yield_budget_s(view()) == 0.0


def test_admission_after_a_yield_keeps_the_yields_reserve():
    co = coserver(quantile=1.0)
    for _ in range(4):
        run_step(co, 0.010)
    co.yield_budget_s(view())
    co.yield_to_backward(0.05, threading.Event())
    run_step(co, 0.0, planned_at_s=0.03)  # the step the yield came before (woken early)
    run_step(co, 0.0)  # a step with no yield before it
    assert co.scheduler.reserves == [0.0] * 4 + [pytest.approx(0.010), 0.0]


def test_the_step_after_a_yield_carries_it_and_the_next_does_not():
    co = coserver(quantile=1.0)
    for _ in range(4):
        run_step(co, 0.0)
    assert co.step_yield_s == 0.0
    co.yield_to_backward(0.03, threading.Event())
    co.yield_to_backward(0.02, threading.Event())  # two yields before one step: both count
    run_step(co, 0.0, planned_at_s=0.05)
    assert co.step_yield_s == pytest.approx(0.05)
    run_step(co, 0.0)
    assert co.step_yield_s == 0.0


def test_a_waiting_requests_slack_keeps_the_lateness_of_each_step_before_its_first_token():
    """A TTFT spans every step queued before it: its slack keeps one step's lateness per
    further step (yields before each of them spent the rest, and a burst's first tokens ran
    late by the steps' summed lateness)."""
    co = coserver(quantile=1.0)
    for _ in range(4):
        run_step(co, 0.010)  # steps end 10 ms past their predictions
    step_tokens = co.scheduler.queue_step_tokens(DECODE)

    def queued(arrival_s: float) -> SchedulingView:
        return SchedulingView(DECODE, now_s=0.0, oldest_decode_token_s=None,
                              waiting=(WaitingRequest(arrival_s, 3 * step_tokens),))

    # the request arrived when its queue priced at the model's rate leaves 0.3 s of slack
    arrival_s = 0.3 - co.scheduler.yield_budget_s(queued(0.0))
    blind = co.scheduler.yield_budget_s(queued(arrival_s))  # no lateness kept for the queue
    assert blind == pytest.approx(0.3)
    assert co.yield_budget_s(queued(arrival_s)) == pytest.approx(blind - 0.010 - 3 * 0.010)
    assert co.yield_budget_s(view()) == pytest.approx(co.scheduler.yield_budget_s(view())
                                                      - 0.010)  # no queue: one step's


def test_steps_after_a_yield_are_learned_and_priced_at_their_own_level():
    """A step after a yield is planned with ``after_yield`` set, and its time moves that level
    only: steps after yields that ran twice their prediction leave the no-yield price alone."""
    co = coserver(quantile=1.0)
    for _ in range(4):
        run_step(co, 0.0)
    no_yield_s = co.latency.predict(DECODE)
    for i in range(30):
        co._clock.now_s = float(i)
        co.yield_to_backward(0.01, threading.Event())
        step = co.plan(view())
        assert step.plan.shape.after_yield and step.plan.shape == DECODE
        co.observe(StepReport(step, DECODE, 2 * co.latency.predict(DECODE)))
    after = StepShape(num_decode=2, kv_tokens=40, after_yield=True)
    assert co.latency.predict(DECODE) == pytest.approx(no_yield_s, rel=0.05)
    assert co.latency.predict(after) > 1.6 * no_yield_s
    step = co.plan(view())  # no yield before this one
    assert not step.plan.shape.after_yield


def test_the_hosts_time_before_its_next_step_counts_where_decodes_wait_for_it():
    co = coserver(quantile=1.0)
    for _ in range(5):
        run_step(co, 0.0)
    co._clock.now_s += 0.030  # the last on time; the host then took 30 ms to its next view
    slack = co.scheduler.yield_budget_s(view())
    assert co.yield_budget_s(view()) == pytest.approx(slack - 0.030)


@pytest.mark.parametrize("between", ["idle", "nothing decoding"])
def test_time_after_a_step_is_not_its_own_where_the_host_idled_or_nothing_decodes(between):
    co = coserver(quantile=1.0)
    for _ in range(4):
        run_step(co, 0.0)
    run_step(co, 0.004)
    co._clock.now_s += 5.0
    if between == "idle":
        co.idle(0.0)
    else:
        co.plan(SchedulingView(StepShape((8,)), now_s=0.0))
    slack = co.scheduler.yield_budget_s(view())
    assert co.yield_budget_s(view()) == pytest.approx(slack - 0.004)


def test_prompts_seen_arriving_keep_room_in_a_prefill_first_hosts_decode_gap():
    """On a phase-separated host the decodes a prefill step defers also wait for prompts that
    arrive before their step runs: the prompt tokens the views showed arriving within the last
    TPOT objective are priced in (the scheduler's closed form), and forgotten after it."""
    co = coserver(quantile=1.0, limits=dataclasses.replace(
        LIMITS, batching=Batching.PHASE_SEPARATED))
    for _ in range(4):
        run_step(co, 0.005)  # decode steps, no prompt queued

    def prefill(now_s: float) -> SchedulingView:  # 4 prompt tokens in the step, 6 queued
        return SchedulingView(StepShape((4,)), now_s=now_s, waiting=(WaitingRequest(now_s, 6),),
                              oldest_decode_token_s=now_s - 0.01, deferred_decode=DECODE)

    sched = co.scheduler
    seen = sched.yield_budget_s(prefill(0.0), ahead=Lookahead(0.005, 10 / SLO.tpot_s)) - 0.005
    blind = sched.yield_budget_s(prefill(0.0), ahead=Lookahead(0.005)) - 0.005
    assert 0 < seen < blind - 0.01
    assert co.yield_budget_s(prefill(0.0)) == pytest.approx(seen)
    assert co.yield_budget_s(prefill(0.0)) == pytest.approx(seen)  # seen again: none new
    assert co.yield_budget_s(prefill(SLO.tpot_s)) == pytest.approx(blind)  # a window later
