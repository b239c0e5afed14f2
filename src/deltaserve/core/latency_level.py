"""The latency model's *level*: actual ÷ fitted per step kind, mode and yield.

A prediction is the fit times the level of its step's kind (:class:`StepKind`), execution mode
and whether a yield to the backward came before it: a moving average of actual ÷ fitted over
the served steps of that key. Calibration probes run on a quiet machine; co-serving, the same
shapes ran 20–30 % slower (decode and inference-prefill steps on the embedded engine, beside a
backward that computes between them: ``latency_model_by_kind`` in the 12-05 bench results), and
the fit, held to its anchors, followed only part of the way. The level follows in tens of steps
whatever the terms cannot express, per kind, without moving the shape the anchors give.

A step after a yield (``StepShape.after_yield``) has a level of its own: on vLLM such mixed+ft
steps ran 15 % over the per-kind level's prediction where the same kind without a yield ran on
it (``latency_model_by_yield``). The fit learns from the no-yield steps only, so it stays the
price of the undisturbed machine and the after-yield level is the ratio to it; until a kind has
been seen after a yield, its no-yield level stands in.

A level is an average; a step that runs late fails every request decoding through it, so the
mixed steps that carry training rows are also priced with their *tail*
(:class:`LatenessTail`): the worst lateness over their prediction of the last served ones
(quantile 1, as the yield reserve). On vLLM they ran 5-19 % over their prediction where Equation
I's pooled p95 margin, mostly inference-only steps, did not cover them
(``results/2026-12-06-vllm-burst-light-r3-timed``).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from deltaserve.core.shape import ExecMode, StepKind

_CLIP = (0.25, 4.0)  # one stalled step moves a level by at most rate × 4


class StepLevels:
    """Exponential moving averages of actual ÷ fitted, by (kind, mode, after a yield);
    ``rate``: the weight of each step (0: every level stays 1)."""

    def __init__(self, rate: float):
        self.rate = rate
        self._level: dict[tuple[StepKind, ExecMode, bool], float] = {}

    def get(self, kind: StepKind, mode: ExecMode, after_yield: bool = False) -> float:
        """The level (1 before any step; after a yield, the no-yield level until one)."""
        fallback = self._level.get((kind, mode, False), 1.0)
        return self._level.get((kind, mode, after_yield), fallback)

    def learn(self, kind: StepKind, mode: ExecMode, after_yield: bool, ratio: float) -> bool:
        """Move the level toward one step's actual ÷ fitted; whether it moved."""
        if self.rate <= 0:
            return False
        level = self.get(kind, mode, after_yield)
        clipped = min(max(ratio, _CLIP[0]), _CLIP[1])
        self._level[kind, mode, after_yield] = level + self.rate * (clipped - level)
        return True


class LatenessTail:
    """A quantile of ``actual / predicted - 1`` over the last ``window`` served steps of one
    kind, clipped to ``[floor, cap]``; ``None`` before the first."""

    def __init__(self, quantile: float, window: int, floor: float, cap: float):
        self.quantile, self.floor, self.cap = quantile, floor, cap
        self._late: deque[float] = deque(maxlen=window)
        self.value: float | None = None

    def learn(self, late: float) -> None:
        self._late.append(late)
        q = float(np.quantile(np.fromiter(self._late, float), self.quantile))
        self.value = min(max(q, self.floor), self.cap)
