"""The simulated clock: events in time order, and time never runs backward."""

from __future__ import annotations

import pytest

from deltaserve.hosts.sim.clock import ClockError, SimClock


def test_events_run_in_time_order_ties_in_scheduling_order():
    clock, seen = SimClock(), []
    for t, tag in ((3.0, "c"), (1.0, "a"), (2.0, "b1"), (2.0, "b2"), (0.0, "z")):
        clock.at(t, lambda t=t, tag=tag: seen.append((clock.now(), tag)))
    clock.run()
    assert seen == [(0.0, "z"), (1.0, "a"), (2.0, "b1"), (2.0, "b2"), (3.0, "c")]


def test_an_event_can_schedule_later_events_and_the_run_stops_when_asked():
    clock, seen = SimClock(), []

    def tick():
        seen.append(clock.now())
        clock.at(clock.now() + 0.5, tick)

    clock.at(0.0, tick)
    assert clock.run(until=lambda: len(seen) == 4)
    assert seen == [0.0, 0.5, 1.0, 1.5]
    assert not clock.run(max_s=2.9)  # stops before the event at 3.0, which stays queued
    assert seen[-1] == 2.5 and clock.next_event_s == 3.0


def test_time_never_runs_backward():
    clock = SimClock()
    clock.at(5.0, lambda: None)
    clock.run()
    assert clock.now() == 5.0
    with pytest.raises(ClockError):
        clock.at(4.999, lambda: None)
    with pytest.raises(ClockError):
        clock.advance_to(1.0)
    with pytest.raises(ClockError):
        clock.at(float("nan"), lambda: None)
    clock.at(5.0, lambda: None)  # now is allowed
    clock.run()
    assert clock.now() == 5.0
