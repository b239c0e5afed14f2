import pytest

from deltaserve.core import InputError, SchedulingView, StepShape, WaitingRequest
from deltaserve.core.arrival_rate import PromptArrivals


def test_queue_growth_is_arrivals_and_steps_run_are_not():
    a = PromptArrivals(window_s=2.0)
    a.seen(10.0, 300)  # 300 prompt tokens waiting at the first view: they arrived
    assert a.tokens_per_s(10.0) == pytest.approx(150.0)
    a.seen(10.1, 300)  # the same step viewed again (before and after a yield): none new
    a.ran(256)  # the step prefilled 256 of them
    a.seen(10.5, 44 + 100)  # 44 left, 100 new
    assert a.tokens_per_s(10.5) == pytest.approx(400 / 2.0)
    a.ran(144)
    a.seen(11.0, 0)  # empty queue: nothing arrived
    a.seen(11.2, 50)  # 50 new
    assert a.tokens_per_s(11.2) == pytest.approx(450 / 2.0)


def test_window_forgets_old_arrivals():
    a = PromptArrivals(window_s=1.0)
    a.seen(0.0, 100)
    a.ran(100)
    a.seen(0.6, 40)
    assert a.tokens_per_s(0.9) == pytest.approx(140.0)
    assert a.tokens_per_s(1.0) == pytest.approx(40.0)  # the first view's arrivals are 1 s old
    assert a.tokens_per_s(1.6) == pytest.approx(0.0)


def test_a_queue_that_shrinks_without_running_counts_no_arrival():
    a = PromptArrivals(window_s=1.0)
    a.seen(0.0, 200)
    a.seen(0.1, 50)  # 150 aborted before they ran
    a.seen(0.2, 120)  # 70 new, counted from the smaller queue
    assert a.tokens_per_s(0.2) == pytest.approx(270.0)
    a.ran(500)  # a host reporting more than was seen never drives the queue negative
    a.seen(0.3, 10)
    assert a.tokens_per_s(0.3) == pytest.approx(280.0)


def test_view_counts_proposed_and_waiting_prompt_tokens():
    waiting = (WaitingRequest(1.0, 0), WaitingRequest(1.1, 40), WaitingRequest(1.2, 340))
    view = SchedulingView(StepShape((100, 56), num_decode=3), 2.0, waiting)
    assert view.queued_prompt_tokens == 100 + 56 + 340
    assert SchedulingView(StepShape(num_decode=3), 2.0).queued_prompt_tokens == 0


@pytest.mark.parametrize("window_s", [0.0, -1.0, float("inf"), float("nan")])
def test_window_must_be_positive_and_finite(window_s):
    with pytest.raises(InputError, match="arrival_window_s"):
        PromptArrivals(window_s)
