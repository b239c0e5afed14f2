"""Latency objectives and the time budget Δ that one step may spend.

Δ = min(TTFT slack, TPOT slack):

* TTFT slack (Eq. III) of a waiting request: ``T_ttft − (now − t_arrival) − queue_wait``, where
  queue wait is the predicted time, after this step, until its first token. Δ takes the
  tightest waiting request; in FCFS order that is usually the earliest one.
* TPOT slack: ``T_tpot − (now − t_last_token)`` of the decode request that has waited longest
  for its next token, less, on a phase-separated host, the decode step this step defers and
  the prompts queued behind it (prefill first: they all run before that decode step), and
  with the share of the host's time that prompts arriving meanwhile will take: they run before
  that decode step too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from deltaserve.core.errors import require


@dataclass(frozen=True)
class SLOConfig:
    """Per-request objectives: time to first token, and the longest gap between two tokens."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        require(math.isfinite(self.ttft_s) and self.ttft_s > 0, "ttft_s", self.ttft_s,
                "an SLO must be a finite number of seconds > 0")
        require(math.isfinite(self.tpot_s) and self.tpot_s > 0, "tpot_s", self.tpot_s,
                "an SLO must be a finite number of seconds > 0")


@dataclass(frozen=True)
class WaitingRequest:
    """A request that has no first token yet. ``tokens_after_step``: prompt tokens of this
    request and of every request ahead of it that remain unprocessed after the proposed step
    (0: its first token comes out of this step)."""

    arrival_s: float
    tokens_after_step: int = 0


@dataclass(frozen=True)
class Lookahead:
    """What the co-server has measured about the steps ahead of the one being priced.

    ``late_s_per_step``: how late recent steps ended past their margin-inflated predictions
    (the yield reserve's lateness; 0 where the host measures none), kept back once for every
    further step a request waits through. ``prompt_tokens_per_s``: prompt tokens that arrived
    at the host per second over the recent window (:mod:`deltaserve.core.arrival_rate`); on a
    phase-separated host they run before a waiting decode step."""

    late_s_per_step: float = 0.0
    prompt_tokens_per_s: float = 0.0


NO_LOOKAHEAD = Lookahead()  # nothing measured: no lateness, no arrivals


@dataclass(frozen=True)
class StepBudget:
    """What a step may cost. ``inf`` slack means no request constrains that side."""

    ttft_slack_s: float
    tpot_slack_s: float

    @property
    def delta_s(self) -> float:
        return min(self.ttft_slack_s, self.tpot_slack_s)


def ttft_slack_s(slo: SLOConfig, now_s: float, waiting: Sequence[WaitingRequest],
                 queue_s_per_token: float, late_s_per_step: float = 0.0,
                 tokens_per_step: int = 1) -> float:
    """Tightest Eq. III slack over waiting requests; queue wait priced per remaining token.

    ``late_s_per_step``: how late a step may end past its margin-inflated prediction, kept
    back once for every further step a request waits through before its first token (its
    ``tokens_after_step`` in steps of ``tokens_per_step`` prompt tokens). A TTFT spans every
    step queued before it, so their lateness adds up; one step's reserve covers one step."""
    if not waiting:
        return math.inf
    step_tokens = max(1, tokens_per_step)
    tightest = min(w.arrival_s - queue_s_per_token * w.tokens_after_step
                   - late_s_per_step * -(-w.tokens_after_step // step_tokens)
                   for w in waiting)
    return slo.ttft_s - now_s + tightest


def tpot_slack_s(slo: SLOConfig, now_s: float, oldest_token_s: float | None,
                 deferred_decode_s: float = 0.0, arriving_share: float = 0.0) -> float:
    """Slack of the decode request that has waited longest for its next token.

    ``deferred_decode_s``: on a phase-separated host, the predicted decode step that must still
    run after this one before that request gets its token (0 on a mixed host).
    ``arriving_share`` (ρ in [0, 1]): on such a host, the share of its time that prompts
    arriving before that decode step will take, each run before it. If this step and the
    deferred work take S + D seconds, arrivals add ρ·(S + D + A) = A of prefill, so the decode
    starts after (S + D)/(1 − ρ): S may be at most (T_tpot − waited)·(1 − ρ) − D.
    """
    if oldest_token_s is None:
        return math.inf
    remaining_s = slo.tpot_s - (now_s - oldest_token_s)
    if remaining_s > 0:  # a gap already past its objective has nothing left to share
        remaining_s *= 1.0 - min(1.0, max(0.0, arriving_share))
    return remaining_s - deferred_decode_s
