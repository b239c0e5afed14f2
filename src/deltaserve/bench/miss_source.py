"""Where a system's SLO misses come from: the yields to the backward, or the steps themselves.

A request misses when its first token comes late (TTFT) or its longest gap between two tokens
is too long (TPOT). Each late event ends with the step that emitted the token: the last step
that ended at or before the token's time (a host emits a step's tokens after it ends). A missed
request counts as *after a yield* when a step that ended one of its late events was preceded by
a yield to the backward (:attr:`~deltaserve.core.contract.StepRecord.yielded_s`), and as *no
yield* otherwise: then the step's own cost (what admission put in it, or inference alone, and
the queue before it) made it late.

This is an attribution by the last step, not a proof of cause: a TTFT miss also waits through
the steps queued before its own, and a yield there counts only if it preceded the step that
emitted the token. It needs one host's timeline: where steps overlap in time (a fleet of
replicas), a token cannot be tied to a step, and nothing is attributed.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from deltaserve.bench.replay import RequestRecord
from deltaserve.core.contract import StepRecord
from deltaserve.core.shape import StepShape
from deltaserve.core.slo import SLOConfig

# steps of one host never overlap; this absorbs the rounding of a step's end less its seconds
_OVERLAP_TOLERANCE_S = 1e-6


@dataclass(frozen=True)
class LateEvent:
    """One late event of a missed request, for a per-request diagnosis. ``event``: ``ttft``
    (its span runs from the request's arrival to its first token) or ``tpot`` (its longest
    gap between two tokens); ``late_ms``: the span less the objective. Over the span: the
    ``steps`` that ended in it and the ``step_s`` of them inside it, ``yielded_s`` lent to the
    backward before those steps, the ``ft_tokens`` they carried, and ``other_s``, the rest
    (the host between steps: the wait for the backward to stop, scheduling, idle time).
    ``repeat``: the run's index among a system's repeats. ``predicted_s``: what the latency
    model predicted for those steps, just before each ran (None where a step's prediction is
    unknown); ``longest``: the longest of them, in tokens (what a late step carried)."""

    request: int
    event: str
    late_ms: float
    span_s: float
    steps: int
    step_s: float
    yielded_s: float
    ft_tokens: int
    other_s: float
    repeat: int = 0
    predicted_s: float | None = None
    longest: str = ""


@dataclass(frozen=True)
class MissSources:
    """``missed`` requests: ``after_yield`` with a late event ended by a step a yield preceded,
    ``no_yield`` with none, ``unattributed`` with no step at or before the late token (or no
    token at all: a request that never started or never finished in time). ``events``: every
    late event, with what its span held."""

    missed: int
    after_yield: int
    no_yield: int
    unattributed: int
    events: tuple[LateEvent, ...] = ()

    def as_json(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        parts = [f"{self.after_yield} on a step after a yield", f"{self.no_yield} not"]
        if self.unattributed:
            parts.append(f"{self.unattributed} unattributed")
        return f"{self.missed} missed ({', '.join(parts)})"


def _late_spans(rec: RequestRecord, slo: SLOConfig) -> list[tuple[str, float, float, float]]:
    """``rec``'s late events as (event, start, end, objective): its arrival to its first token
    when TTFT is late, its longest gap when TPOT is. Each ends with the token that was late."""
    times = rec.token_times_s
    out = []
    if rec.ttft_s is not None and rec.ttft_s > slo.ttft_s:
        out.append(("ttft", rec.scheduled_s, times[0], slo.ttft_s))
    if rec.max_tpot_s > slo.tpot_s:
        start, end = max(itertools.pairwise(times), key=lambda gap: gap[1] - gap[0])
        out.append(("tpot", start, end, slo.tpot_s))
    return out


def describe_shape(shape: StepShape) -> str:
    """A step's work in tokens, e.g. ``prefill 512 (2) + 7 decodes + ft 256``."""
    parts = []
    if shape.prefill_lens:
        parts.append(f"prefill {shape.num_prefill_tokens} ({len(shape.prefill_lens)})")
    if shape.num_decode:
        parts.append(f"{shape.num_decode} decode{'' if shape.num_decode == 1 else 's'}")
    if shape.ft_lens:
        parts.append(f"ft {sum(shape.ft_lens)}")
    return " + ".join(parts) or "empty"


def _late_event(request: int, span: tuple[str, float, float, float],
                ordered: Sequence[StepRecord], ends: list[float],
                predicted: Mapping[tuple[StepShape, float], float]) -> LateEvent:
    """What the steps that ended inside ``span`` held (a step that began before the span
    counts the part inside it; its yield, which came before it began, does not count)."""
    event, t0, t1, objective_s = span
    lo, hi = bisect.bisect_right(ends, t0), bisect.bisect_right(ends, t1)
    inside = ordered[lo:hi]
    step_s = sum(min(s.seconds, s.t_s - t0) for s in inside)
    yielded_s = sum(s.yielded_s for s in inside if s.t_s - s.seconds >= t0)
    span_s = t1 - t0
    guesses = [predicted.get((s.shape, s.seconds)) for s in inside]
    predicted_s = (round(sum(g for g in guesses if g is not None), 6)
                   if inside and None not in guesses else None)
    longest = describe_shape(max(inside, key=lambda s: s.seconds).shape) if inside else ""
    return LateEvent(request, event, round((span_s - objective_s) * 1e3, 3), round(span_s, 6),
                     len(inside), round(step_s, 6), round(yielded_s, 6),
                     sum(s.ft_tokens for s in inside),
                     round(max(0.0, span_s - step_s - yielded_s), 6),
                     predicted_s=predicted_s, longest=longest)


def _one_timeline(steps: Sequence[StepRecord]) -> bool:
    return all(b.t_s - b.seconds >= a.t_s - _OVERLAP_TOLERANCE_S
               for a, b in itertools.pairwise(steps))


def miss_sources(records: Sequence[RequestRecord], steps: Sequence[StepRecord],
                 slo: SLOConfig, missed: Sequence[bool],
                 predicted: Mapping[tuple[StepShape, float], float] | None = None
                 ) -> MissSources | None:
    """The missed requests (``missed[i]`` for ``records[i]``, as the metrics judge them) by
    where their late events fell; None where the steps are not one host's timeline.
    ``predicted``: the latency model's prediction of each step, by (shape, seconds)."""
    ordered = sorted(steps, key=lambda s: s.t_s)
    if not _one_timeline(ordered):
        return None
    ends = [s.t_s for s in ordered]
    after = none = unattributed = 0
    events: list[LateEvent] = []
    for rec, miss in zip(records, missed, strict=True):
        if not miss:
            continue
        spans = _late_spans(rec, slo)
        events += [_late_event(rec.index, span, ordered, ends, predicted or {}) for span in spans]
        found = [ordered[i - 1] for span in spans
                 if (i := bisect.bisect_right(ends, span[2])) > 0]
        if not found:
            unattributed += 1
        elif any(s.yielded_s > 0 for s in found):
            after += 1
        else:
            none += 1
    return MissSources(after + none + unattributed, after, none, unattributed, tuple(events))
