"""Progress lines in the server log: every job state change, and optimizer steps at a bounded
pace (the first step, then at most one line per job per interval)."""

from __future__ import annotations

import logging
import time

from deltaserve.server.protocols import StepMetrics

log = logging.getLogger("deltaserve.server.jobs")


class ProgressLog:
    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._last_s: dict[str, float] = {}

    def state(self, job_id: str, message: str) -> None:
        log.info("job %s: %s", job_id, message)

    def step(self, job_id: str, m: StepMetrics) -> None:
        now = time.monotonic()
        last = self._last_s.get(job_id)
        if last is not None and now - last < self.interval_s:
            return
        self._last_s[job_id] = now
        valid = f", valid_loss {m.valid_loss:.4f}" if m.valid_loss is not None else ""
        log.info("job %s: step %d, train_loss %.4f, token accuracy %.3f%s, %d tokens trained",
                 job_id, m.step, m.train_loss, m.train_mean_token_accuracy, valid,
                 m.trained_tokens)

    def forget(self, job_id: str) -> None:
        self._last_s.pop(job_id, None)
