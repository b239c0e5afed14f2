"""Fit a trace to a host: rate scaled so its peak is a stated fraction of measured capacity.

Capacity comes from the host's calibrated latency model: serving requests of the trace's mean
shape in rounds of B concurrent requests (their prefills in full steps, then their decodes
together), the best B gives the most requests per second the host sustains.
"""

from __future__ import annotations

import math
import statistics

from deltaserve.core.calibration import HostLimits
from deltaserve.core.errors import require
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.shape import StepShape
from deltaserve.workloads.trace import Trace


def capacity_rps(model: LatencyModel, limits: HostLimits, prompt_tokens: int,
                 output_tokens: int) -> float:
    best = 0.0
    for b in range(1, limits.max_seqs_per_step + 1):
        total_prefill = b * prompt_tokens
        full, rest = divmod(total_prefill, limits.max_tokens_per_step)
        prefill_s = full * model.predict(StepShape((limits.max_tokens_per_step,)))
        if rest:
            prefill_s += model.predict(StepShape((rest,)))
        kv = b * (prompt_tokens + output_tokens // 2)
        if b * (prompt_tokens + output_tokens) > limits.max_kv_tokens:
            break
        decode_s = (output_tokens - 1) * model.predict(StepShape(num_decode=b, kv_tokens=kv))
        best = max(best, b / (prefill_s + decode_s))
    return best


def auto_scale(trace: Trace, model: LatencyModel, limits: HostLimits, *,
               peak_fraction: float = 0.8, bin_s: float = 1.0, seed: int = 0
               ) -> tuple[Trace, float, float]:
    """The trace with its rate scaled so its peak (over ``bin_s`` bins) is ``peak_fraction``
    of the host's capacity. Returns the trace, the factor and the capacity in req/s."""
    require(0 < peak_fraction <= 2, "peak_fraction", peak_fraction, "must be in (0, 2]")
    # mean lengths: the heavy tail, not the median request, sets how much work arrives
    p = round(statistics.fmean(r.prompt_tokens for r in trace.requests))
    o = round(statistics.fmean(r.output_tokens for r in trace.requests))
    cap = capacity_rps(model, limits, p, o)
    require(cap > 0 and math.isfinite(cap), "capacity", cap, "the latency model is not fitted")
    factor = peak_fraction * cap / trace.peak_rate(bin_s)
    return trace.scale_rate(factor, seed=seed), factor, cap
