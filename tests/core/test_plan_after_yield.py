"""``plan_after_yield``: the one yield before a step that every pausing host makes, against a
stand-in co-server that records the calls it gets."""

from __future__ import annotations

import threading

from deltaserve.core import SchedulingView, StepShape
from deltaserve.core.contract import plan_after_yield

DECODE = StepShape(num_decode=3, kv_tokens=60)
TRAIN_ONLY = StepShape(ft_lens=(32,))


class StandInCo:
    """Prices every step at ``budget_s``; records the yields and the views planned."""

    def __init__(self, budget_s: float):
        self.budget_s = budget_s
        self.priced: list[SchedulingView] = []
        self.yields: list[tuple[float, threading.Event]] = []
        self.planned: list[SchedulingView] = []

    def yield_budget_s(self, view: SchedulingView) -> float:
        self.priced.append(view)
        return self.budget_s

    def yield_to_backward(self, seconds: float, wake: threading.Event) -> float:
        self.yields.append((seconds, wake))
        return seconds

    def plan(self, view: SchedulingView) -> str:
        self.planned.append(view)
        return "step"


def clock_at(*times: float):
    it = iter(times)
    return lambda: next(it)


def test_a_priced_budget_is_lent_then_the_step_is_planned_at_the_time_after_it():
    co, wake = StandInCo(0.25), threading.Event()
    view = SchedulingView(DECODE, now_s=10.0, oldest_decode_token_s=9.9)
    assert plan_after_yield(co, view, wake, clock_at(10.3)) == "step"
    assert co.priced == [view]
    assert co.yields == [(0.25, wake)]  # the priced budget exactly, woken by the host's event
    (planned,) = co.planned
    assert planned.now_s == 10.3 and planned.proposed == DECODE
    assert planned.oldest_decode_token_s == 9.9


def test_no_slack_no_yield_and_the_view_is_planned_as_given():
    co = StandInCo(0.0)
    view = SchedulingView(DECODE, now_s=10.0)
    plan_after_yield(co, view, threading.Event(), clock_at())  # the clock is never read
    assert co.priced == [view] and co.yields == [] and co.planned == [view]


def test_a_step_without_inference_is_never_priced_for_a_yield():
    """A training-only step has no client to pause for: the idle path lends that time."""
    co = StandInCo(0.25)
    view = SchedulingView(TRAIN_ONLY, now_s=10.0)
    plan_after_yield(co, view, threading.Event(), clock_at())
    assert co.priced == [] and co.yields == [] and co.planned == [view]
