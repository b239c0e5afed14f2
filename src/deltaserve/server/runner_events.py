"""A co-server's training events as a job's runner events.

The co-server reports on the host's stepping thread (and, while it closes, on the caller's);
:class:`EventTranslator` takes them from any thread and hands the job driver OpenAI-shaped
events in the order they happened:

=========================  ==============================================================
co-server                   job
=========================  ==============================================================
``OptimizerStep``           ``StepEvent``: 1-based step, train loss and token accuracy,
                            the job's trained tokens; held back while its
                            ``ValidationLoss`` is owed (``validating``), so the step's one
                            ``metrics`` event carries ``valid_loss``
``ValidationLoss``          fills that step's ``valid_loss`` (a failed one: a notice)
``CheckpointSaved``         ``CheckpointEvent`` with the metrics of the step it holds (none
                            for step 0: nothing was trained)
``StepLost``                ``NoticeEvent``: the step's samples train again
``TrainingIOError``         ``NoticeEvent``: training waits until the write succeeds
``TrainingStopped``         nothing here: the runner fails the job (``training_failed``)
=========================  ==============================================================
"""

from __future__ import annotations

import threading
from collections import deque
from pathlib import Path

from deltaserve.server.protocols import (
    CheckpointEvent,
    NoticeEvent,
    RunnerEvent,
    StepEvent,
    StepMetrics,
)
from deltaserve.train.events import (
    CheckpointSaved,
    OptimizerStep,
    StepLost,
    TrainingEvent,
    TrainingIOError,
    ValidationLoss,
)


def _last_line(text: str) -> str:
    """A traceback's last line (its exception), for an event a person reads."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else text[:300]


class EventTranslator:
    """``trained_tokens``: the job's tokens committed before this run (a resumed checkpoint's);
    ``resumed``: that checkpoint's metrics (a checkpoint of the same step reuses them)."""

    def __init__(self, trained_tokens: int, resumed: StepMetrics | None):
        self._lock = threading.Lock()
        self._tokens = trained_tokens
        self._last = resumed
        self._pending: deque[TrainingEvent] = deque()
        self._valid: dict[int, ValidationLoss] = {}
        self._checkpoint: tuple[int, str] | None = None  # the last one reported

    def feed(self, event: TrainingEvent) -> None:
        """From any thread; never raises into the caller's step (a bug here is the job's, not the
        host's)."""
        with self._lock:
            if isinstance(event, ValidationLoss):
                self._valid[event.step] = event
            self._pending.append(event)

    @property
    def last_metrics(self) -> StepMetrics | None:
        with self._lock:
            return self._last

    def take(self) -> list[RunnerEvent]:
        """The events ready so far, oldest first: up to a step still waiting for its
        validation loss."""
        out: list[RunnerEvent] = []
        with self._lock:
            while self._pending:
                ev = self._pending[0]
                if isinstance(ev, OptimizerStep) and ev.validating and ev.step not in self._valid:
                    break
                self._pending.popleft()
                out += self._translate(ev)
        return out

    def _translate(self, ev: TrainingEvent) -> list[RunnerEvent]:
        if isinstance(ev, OptimizerStep):
            return self._step(ev)
        if isinstance(ev, CheckpointSaved):
            m = self._last
            if m is None or m.step != ev.step or self._checkpoint == (ev.step, ev.path):
                # step 0 (nothing trained), a step whose metrics never came, or the same
                # checkpoint again (the last step's, saved once more as the co-server closed)
                return []
            self._checkpoint = (ev.step, ev.path)
            return [CheckpointEvent(Path(ev.path), m)]
        if isinstance(ev, StepLost):
            return [NoticeEvent(f"Step {ev.step + 1} did not reach the adapter "
                                f"({_last_line(ev.reason)}); its {ev.num_samples} samples "
                                "train again")]
        if isinstance(ev, TrainingIOError):
            return [NoticeEvent(f"Could not write the {ev.what} ({ev.error}); training waits "
                                "and retries until the write succeeds")]
        return []  # ValidationLoss: merged into its step; TrainingStopped: the runner's

    def _step(self, ev: OptimizerStep) -> list[RunnerEvent]:
        self._tokens += ev.num_tokens
        notes: list[RunnerEvent] = []
        valid_loss = None
        if ev.validating:
            v = self._valid.pop(ev.step)
            valid_loss = v.loss
            if v.loss is None:
                notes.append(NoticeEvent(f"Validation after step {ev.step + 1} did not run: "
                                         f"{_last_line(v.error or 'unknown error')}"))
        self._last = StepMetrics(ev.step + 1, ev.loss, ev.mean_token_accuracy, self._tokens,
                                 valid_loss)
        return [StepEvent(self._last), *notes]
