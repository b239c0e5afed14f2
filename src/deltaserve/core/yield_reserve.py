"""How much of a step's slack a yield to the backward may spend.

Before a host step, Δ less the step's margin-inflated prediction is what the SLOs leave; a
host on an ``exclusive`` grant may lend that time to the backward first. A yield that spends all
of it lands the step on its deadline, so every error of the prediction, and the backward's stop
at a layer boundary running past the yield, becomes a miss. And the TPOT objective is a
request's longest gap, a maximum over every step it decodes in: a per-step miss rate of a few
percent fails most requests that decode for tens of steps.

So a yield leaves a reserve unspent: how late recent inference steps ended against their
margin-inflated predictions, counted from when each was due to start (the wait for the backward
to park, the co-server's bookkeeping and a yield's overrun included); never less than the
layer-boundary floor the caller gives. The default keeps the latest of the window's steps
(quantile 1): a request decodes for tens of steps and misses its TPOT objective if any one of
them runs late, so a per-step quantile such as the p99 leaves most long requests exposed
(a run with the p99 still had requests miss by a few percent). It yields nothing until it has
seen enough steps to know how late they run.

A step is late until the host can start the next one, not only until its forward returns: a
decode's token gap spans the host's work between steps too (its output handling, its loop, its
next scheduling pass; on vLLM a median of 12 to 16 ms between decode steps, see
``docs/results.md``). So where the next step's view has decodes in flight, and the engine
therefore starts it at once, a step counts as late as that view's time; where it has none, or
the host went idle in between, the step counts to its own end (the time since was no step's).

The window's latest step is only the latest *seen*: the next one may run later still, and one
such step fails every request decoding through it. So a yield spends only ``spend_fraction`` of
the slack the reserve leaves, keeping the rest for lateness the window has not seen yet.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import numpy as np

from deltaserve.core.errors import require


@dataclass(frozen=True)
class YieldReserveConfig:
    """``quantile`` of the last ``window`` inference steps' lateness is kept unspent;
    ``min_steps``: steps seen before the first yield; ``spend_fraction``: the share of the slack
    left after the reserve that one yield may spend."""

    quantile: float = 1.0
    window: int = 512
    min_steps: int = 32
    spend_fraction: float = 0.5

    def __post_init__(self) -> None:
        require(0.0 < self.quantile <= 1.0, "yield_reserve_quantile", self.quantile,
                "must be in (0, 1]")
        require(self.window >= 1, "yield_reserve_window", self.window, "must be >= 1")
        require(1 <= self.min_steps <= self.window, "yield_reserve_min_steps", self.min_steps,
                f"must be in [1, window={self.window}]")
        require(0.0 < self.spend_fraction <= 1.0, "yield_reserve_spend_fraction",
                self.spend_fraction, "must be in (0, 1]")


class YieldReserve:
    """Lateness of recent inference steps, and the yield budget it leaves."""

    def __init__(self, config: YieldReserveConfig | None = None):
        self.config = config or YieldReserveConfig()
        self._late_s: collections.deque[float] = collections.deque(maxlen=self.config.window)
        self._cached: tuple[int, float] = (-1, 0.0)  # (observations, quantile) of the last call
        self._seen = 0
        self._pending: tuple[float, float] | None = None  # (due_s, ended_s) of the last step

    def observe(self, late_s: float) -> None:
        """An inference step ended ``late_s`` seconds after its planning time plus its
        margin-inflated prediction (negative: early)."""
        if math.isfinite(late_s):
            self._late_s.append(late_s)
            self._seen += 1

    def step_ended(self, due_s: float, ended_s: float) -> None:
        """An inference step was due to end at ``due_s`` (its planning time plus its
        margin-inflated prediction) and ended at ``ended_s``; how late it counts is settled by
        :meth:`next_step`."""
        self.next_step(None)  # a step before it that nothing settled counts to its own end
        self._pending = (due_s, ended_s)

    def next_step(self, started_s: float | None) -> None:
        """The host built its next step's view at ``started_s`` with decodes in flight
        (``None``: it went idle, or nothing decodes): the step before counts as late as the
        later of its end and ``started_s``."""
        if self._pending is None:
            return
        (due_s, ended_s), self._pending = self._pending, None
        self.observe((ended_s if started_s is None else max(ended_s, started_s)) - due_s)

    def reserve_s(self, floor_s: float) -> float:
        """Seconds a yield leaves unspent (``inf`` until ``min_steps`` steps were seen)."""
        if len(self._late_s) < self.config.min_steps:
            return math.inf
        seen, q = self._cached
        if seen != self._seen:
            q = float(np.quantile(np.fromiter(self._late_s, float), self.config.quantile))
            self._cached = (self._seen, q)
        return max(floor_s, q)

    def budget_s(self, slack_s: float, floor_s: float, cap_s: float) -> float:
        """The yield for a step whose SLOs leave ``slack_s`` after its prediction:
        ``spend_fraction`` of the slack less the reserve, at most ``cap_s``; none if that is
        less than ``floor_s`` (the backward could not finish a layer in it)."""
        reserve_s = self.reserve_s(floor_s)
        if math.isinf(reserve_s):
            return 0.0
        spend_s = self.config.spend_fraction * (slack_s - reserve_s)
        return min(spend_s, cap_s) if spend_s >= floor_s else 0.0
