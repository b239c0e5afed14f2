"""One system's repeats as one score: each metric's median and, kept beside it, every repeat's
metrics (their min and max are the range the report prints).

The median is the lower middle value (``statistics.median_low``): every figure it reports is a
value some repeat measured, so an even count does not average two runs into one no run had,
and a harvest ratio stays its tokens over its charge.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import fields, replace

from deltaserve.bench import metrics as M
from deltaserve.bench.latency_holdout import ModeError, pooled_kind_errors
from deltaserve.bench.miss_source import MissSources
from deltaserve.bench.score import SystemScore
from deltaserve.core.errors import require


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median_low(present) if present else None


def _total_misses(per_run: Sequence[MissSources | None]) -> MissSources | None:
    """The repeats' missed requests added up, by where they fell (None if a repeat has no
    attribution: its steps were not one timeline)."""
    if any(m is None for m in per_run):
        return None
    present = [m for m in per_run if m is not None]
    counts = [f.name for f in fields(MissSources) if f.name != "events"]
    return MissSources(*(sum(getattr(m, name) for m in present) for name in counts),
                       events=tuple(replace(e, repeat=k) for k, m in enumerate(present)
                                    for e in m.events))


def median_metrics(runs: Sequence[M.SystemMetrics]) -> M.SystemMetrics:
    """Each field's median over ``runs`` (None where no run has a value)."""
    return M.SystemMetrics(**{f.name: _median([getattr(m, f.name) for m in runs])
                              for f in fields(M.SystemMetrics)})


def pooled_errors(per_run: Sequence[tuple[ModeError, ...]]) -> tuple[ModeError, ...]:
    """The latency model's error per mode over every repeat's steps (step-weighted)."""
    modes: dict[str, list[ModeError]] = {}
    for errors in per_run:
        for e in errors:
            modes.setdefault(e.mode, []).append(e)

    def pool(errs: list[ModeError], mape: str, steps: str) -> tuple[float | None, int]:
        scored = [e for e in errs if getattr(e, mape) is not None and getattr(e, steps)]
        n = sum(getattr(e, steps) for e in scored)
        return (sum(getattr(e, mape) * getattr(e, steps) for e in scored) / n if n else None,
                sum(getattr(e, steps) for e in errs))

    return tuple(ModeError(mode, *pool(errs, "online_mape", "online_steps"),
                           *pool(errs, "heldout_mape", "heldout_steps"))
                 for mode, errs in modes.items())


def summarize(scores: Sequence[SystemScore]) -> SystemScore:
    """One system's repeats (the same system, SLO and hardware share) as one score: medians,
    the harvest of the median tokens (its charge is the same in every repeat: one window, one
    idle capacity), the latency error pooled, and every repeat's metrics in ``runs``. One
    repeat is returned as it is."""
    require(len(scores) >= 1, "repeats", len(scores), "need at least one run to summarize")
    first = scores[0]
    require(all(s.name == first.name and s.share == first.share for s in scores), "repeats",
            [s.name for s in scores], "summarizes one system's runs only")
    if len(scores) == 1:
        return first
    tokens = statistics.median_low([s.harvest.ft_tokens for s in scores])
    return replace(first, metrics=median_metrics([s.metrics for s in scores]),
                   harvest=replace(first.harvest, ft_tokens=tokens),
                   latency=pooled_errors([s.latency for s in scores]),
                   latency_kinds=pooled_kind_errors([s.latency_kinds for s in scores]),
                   latency_yields=pooled_kind_errors([s.latency_yields for s in scores]),
                   padded_token_efficiency=_median([s.padded_token_efficiency for s in scores]),
                   drained_s=_median([s.drained_s for s in scores]),
                   misses=_total_misses([s.misses for s in scores]),
                   runs=tuple(s.metrics for s in scores))
