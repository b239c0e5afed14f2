"""The simulated clock and its event queue (discrete-event simulation).

Time is a float in simulated seconds. Events run in order of their time, ties in the order they
were scheduled; running an event moves the clock to its time first. The clock never runs
backward: scheduling an event in the past, or moving the clock to an earlier time, raises.
Everything a simulated host stamps (arrivals, tokens, steps, optimizer steps) reads :meth:`now`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

Action = Callable[[], None]


class ClockError(RuntimeError):
    """Simulated time was asked to run backward (a bug in the simulation)."""


class SimClock:
    def __init__(self, start_s: float = 0.0):
        self._now = float(start_s)
        self._queue: list[tuple[float, int, Action]] = []
        self._order = itertools.count()
        self.events_run = 0

    def now(self) -> float:
        return self._now

    __call__ = now  # a clock is what BaseHost calls for the time

    def advance_to(self, t_s: float) -> None:
        if t_s < self._now:
            raise ClockError(f"simulated time would run backward: {t_s!r} < {self._now!r}")
        self._now = t_s

    def at(self, t_s: float, action: Action) -> None:
        """Run ``action`` at simulated time ``t_s`` (>= now)."""
        if not t_s >= self._now:  # also refuses NaN
            raise ClockError(f"event scheduled in the past: {t_s!r} < now {self._now!r}")
        heapq.heappush(self._queue, (t_s, next(self._order), action))

    @property
    def next_event_s(self) -> float:
        return self._queue[0][0] if self._queue else math.inf

    def run(self, until: Callable[[], bool] | None = None, max_s: float = math.inf) -> bool:
        """Run events in time order until the queue is empty, ``until()`` holds (checked after
        every event) or the next event is later than ``max_s``. Returns whether ``until`` was
        met (always ``False`` without one)."""
        while self._queue and self._queue[0][0] <= max_s:
            t_s, _, action = heapq.heappop(self._queue)
            self.advance_to(t_s)
            action()
            self.events_run += 1
            if until is not None and until():
                return True
        return False
