"""A host's inference counters, as a server exports them: output tokens, finished requests and
SLO misses by kind, each measured from the request's own token times.

TTFT is first token minus arrival; TPOT is the longest gap between two consecutive tokens (the
bench's definition, :mod:`deltaserve.bench.metrics`). A request aborted by its client is not
counted as finished. Thread-safe: a host's stepping thread records, a metrics endpoint reads.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

from deltaserve.core.requests import RequestOutput
from deltaserve.core.slo import SLOConfig


@dataclass(frozen=True)
class RequestTotals:
    """Totals since the counters were created. ``slo_missed``: requests that missed either
    objective (each also counted under its kinds in ``ttft_misses`` / ``tpot_misses``)."""

    output_tokens: int = 0
    finished: int = 0
    slo_missed: int = 0
    ttft_misses: int = 0
    tpot_misses: int = 0


def ttft_s(out: RequestOutput) -> float | None:
    return None if out.first_token_s is None else out.first_token_s - out.arrival_s


def max_tpot_s(out: RequestOutput) -> float:
    return max((b - a for a, b in itertools.pairwise(out.token_times_s)), default=0.0)


class RequestCounters:
    def __init__(self, slo: SLOConfig | None = None):
        self.slo = slo  # None: nothing is a miss (no objective configured)
        self._lock = threading.Lock()
        self._totals = RequestTotals()

    def set_slo(self, slo: SLOConfig | None) -> None:
        with self._lock:
            self.slo = slo

    def tokens(self, n: int) -> None:
        if n:
            with self._lock:
                t = self._totals
                self._totals = RequestTotals(t.output_tokens + n, t.finished, t.slo_missed,
                                             t.ttft_misses, t.tpot_misses)

    def finished(self, out: RequestOutput) -> None:
        """A request ended (``abort``: not counted)."""
        if out.finish_reason == "abort":
            return
        with self._lock:
            slo, t = self.slo, self._totals
            first = ttft_s(out)
            ttft_miss = slo is not None and (first is None or first > slo.ttft_s)
            tpot_miss = slo is not None and max_tpot_s(out) > slo.tpot_s
            self._totals = RequestTotals(t.output_tokens, t.finished + 1,
                                         t.slo_missed + (ttft_miss or tpot_miss),
                                         t.ttft_misses + ttft_miss, t.tpot_misses + tpot_miss)

    def totals(self) -> RequestTotals:
        with self._lock:
            return self._totals
