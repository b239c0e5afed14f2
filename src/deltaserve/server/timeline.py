"""The dashboard's time series: the co-server's counters sampled at a fixed interval and turned
into rates (the paper's Figure 5: inference and fine-tuning throughput over time) and the SLO
attainment of the requests that finished in each interval."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

from deltaserve.server.protocols import ServingStats, ServingStatsSnapshot

log = logging.getLogger("deltaserve.server")


@dataclass(frozen=True)
class TimelinePoint:
    t_s: float  # seconds since the server started
    inference_tokens_per_s: float
    ft_tokens_per_s: float
    slo_attainment: float | None  # None: no request finished in the interval
    requests_finished: int


class Timeline:
    def __init__(self, stats: ServingStats, interval_s: float, max_points: int):
        self.stats = stats
        self.interval_s = interval_s
        self._points: deque[TimelinePoint] = deque(maxlen=max_points)
        self._start_s = time.monotonic()
        self._last: tuple[float, ServingStatsSnapshot] | None = None

    def sample(self) -> TimelinePoint | None:
        """Read the counters once; a point per interval after the first reading."""
        now, snap = time.monotonic(), self.stats.snapshot()
        last, self._last = self._last, (now, snap)
        if last is None or now <= last[0]:
            return None
        dt, prev = now - last[0], last[1]
        finished = snap.requests_finished - prev.requests_finished
        missed = snap.requests_slo_missed - prev.requests_slo_missed
        point = TimelinePoint(
            t_s=now - self._start_s,
            inference_tokens_per_s=(snap.inference_tokens - prev.inference_tokens) / dt,
            ft_tokens_per_s=(snap.ft_tokens_committed - prev.ft_tokens_committed) / dt,
            slo_attainment=(finished - missed) / finished if finished > 0 else None,
            requests_finished=finished)
        self._points.append(point)
        return point

    def points(self) -> list[TimelinePoint]:
        return list(self._points)

    async def run(self) -> None:
        """Sample until cancelled; a failing snapshot is logged and skipped."""
        while True:
            try:
                self.sample()
            except Exception:
                log.exception("dashboard: could not read the serving stats")
            await asyncio.sleep(self.interval_s)
