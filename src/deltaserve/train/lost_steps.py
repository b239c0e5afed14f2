"""Lost optimizer steps: what a person and a scraper see of them, and when training gives up.

A backward job that raises, or whose process dies, loses its optimizer step (its samples go
back to the pool and train again). Each loss is counted by a bounded *kind* (the exception's
class, or ``worker_died``) for ``/metrics``, and logged at WARNING without flooding the log: the
first loss of each distinct reason with its whole traceback, repeats of it at running counts
1, 2, 4, 8, … on one line. A run that loses every step must say so, not report zero
throughput: after ``stop_after`` consecutive losses (no step committed between them) the
co-server stops training with a :class:`TrainingFailed` carrying the reason; inference goes on.
"""

from __future__ import annotations

import logging
from collections import Counter

logger = logging.getLogger("deltaserve")

WORKER_DIED = "worker_died"


class TrainingFailed(RuntimeError):
    """Training stopped: ``lost_steps`` optimizer steps in a row were lost, the last one for
    ``reason`` (an exception's last line, or how the backward process died). ``cause``: why it
    stopped, where that is not the run of lost steps (a data-parallel group that lost a
    member stops at its first lost step)."""

    def __init__(self, reason: str, lost_steps: int, *, cause: str | None = None):
        self.cause = cause
        cause = cause or (f"{lost_steps} optimizer steps in a row were lost and none committed "
                          f"between them")
        super().__init__(f"fine-tuning stopped: {cause}; last reason: {reason}")
        self.reason = reason
        self.lost_steps = lost_steps


def reason_summary(reason: str) -> str:
    """A traceback's last line (its exception), or the reason as it is."""
    lines = [ln for ln in reason.strip().splitlines() if ln.strip()]
    return lines[-1].strip()[:300] if lines else reason[:300]


def reason_kind(reason: str, process_died: bool) -> str:
    """The ``/metrics`` label of a loss: few distinct values (never the message itself)."""
    if process_died:
        return WORKER_DIED
    head = reason_summary(reason).split(":", 1)[0].strip()
    name = head.rsplit(".", 1)[-1]
    return name if name.isidentifier() else "error"


class LostSteps:
    """Counts of lost steps by kind, the log lines, and the give-up rule (``stop_after`` ≥ 1
    consecutive losses)."""

    def __init__(self, stop_after: int):
        self.stop_after = stop_after
        self.by_kind: Counter[str] = Counter()
        self._by_reason: Counter[str] = Counter()
        self.consecutive = 0

    def lost(self, step: int, reason: str, process_died: bool) -> TrainingFailed | None:
        """Record a lost step; the error to stop training with once the rule is met."""
        kind, summary = reason_kind(reason, process_died), reason_summary(reason)
        self.by_kind[kind] += 1
        self._by_reason[summary] += 1
        n = self._by_reason[summary]
        if n == 1:
            logger.warning("optimizer step %d lost (%s); its samples train again. Reason:\n%s",
                           step, kind, reason.rstrip())
        elif n & (n - 1) == 0:  # 2, 4, 8, ...: a running count, not a line per loss
            logger.warning("optimizer steps lost %d times so far for the same reason: %s", n,
                           summary)
        self.consecutive += 1
        if self.consecutive >= self.stop_after:
            return TrainingFailed(summary, self.consecutive)
        return None

    def committed(self) -> None:
        self.consecutive = 0
