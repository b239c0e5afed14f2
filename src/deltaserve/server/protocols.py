"""What the service needs from the rest of DeltaServe: three narrow Protocols.

* :class:`InferenceBackend`: a running host (the embedded engine, vLLM, ...). Every method is
  thread-safe; token callbacks arrive on the host's own loop thread.
* :class:`TrainingRunner`: the co-server's training side on that host, one job at a time.
* :class:`ServingStats`: a typed snapshot of the co-server's counters, read by ``/metrics`` and
  the dashboard.

The server never reaches past these, so any host that satisfies them is served unchanged, and
the tests drive the whole service with in-process fakes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from deltaserve.core.admission import Skip
from deltaserve.core.data import TrainingSample
from deltaserve.core.requests import SamplingParams, TokenCallback
from deltaserve.core.tokenizer import Tokenizer


@runtime_checkable
class InferenceBackend(Protocol):
    """A running host; every method thread-safe."""

    model_name: str  # the base model's name as /v1/models lists it
    tokenizer: Tokenizer | None  # the service needs one (checked before it starts)
    max_model_len: int

    def add_request(self, prompt: Sequence[int], params: SamplingParams, *,
                    adapter: str | None = None, callback: TokenCallback | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; ``callback`` gets a ``RequestOutput`` after every new token and once
        finished, on the host's thread. Raises ``InputError`` for a request it cannot serve."""
        ...

    def abort_request(self, request_id: str) -> None:
        """Drop a request (its client went away); no-op for an unknown or finished one."""
        ...

    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT directory ``path`` as adapter ``name``."""
        ...

    def remove_lora(self, name: str) -> None:
        ...

    def lora_names(self) -> list[str]:
        ...


# ---- training -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainingHyperparameters:
    """What a job trains with, resolved from OpenAI's hyperparameters (see ``hyperparameters``)."""

    n_epochs: int
    learning_rate: float
    backward_batch_tokens: int  # tokens of whole samples per optimizer step


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step as OpenAI's ``metrics`` event reports it. ``step`` is 1-based and
    counts across epochs; ``trained_tokens`` are the job's tokens committed so far."""

    step: int
    train_loss: float
    train_mean_token_accuracy: float
    trained_tokens: int
    valid_loss: float | None = None


@dataclass(frozen=True)
class JobDefaults:
    """What ``auto`` hyperparameters resolve to on a runner, and the longest training sample it
    takes (longer ones are dropped and counted when the files are read)."""

    n_epochs: int
    learning_rate: float
    backward_batch_tokens: int
    max_sample_tokens: int


@dataclass(frozen=True)
class TrainingJobSpec:
    """Everything a runner needs to train one job. ``checkpoint_dir`` is the job's own directory
    under ``--data-dir``; ``resume_from`` a checkpoint directory the runner wrote earlier
    (reported by a :class:`CheckpointEvent`, with ``resume_metrics``), or None for a fresh
    start. ``resume_from`` is authoritative: the job resumes from exactly it, whatever newer
    checkpoint the runner may have written and not reported before a crash (those steps train
    again, so the job's events, checkpoints and adapter agree)."""

    job_id: str
    base_model: str
    train_samples: tuple[TrainingSample, ...]
    valid_samples: tuple[TrainingSample, ...]  # empty: no validation file
    hyperparameters: TrainingHyperparameters
    seed: int
    checkpoint_dir: Path
    checkpoint_every_steps: int
    resume_from: Path | None = None
    resume_metrics: StepMetrics | None = None


@dataclass(frozen=True)
class StepEvent:
    """An optimizer step landed in the adapter."""

    metrics: StepMetrics


@dataclass(frozen=True)
class CheckpointEvent:
    """A checkpoint is complete on disk. ``path`` is a PEFT directory (``adapter_config.json`` +
    ``adapter_model.safetensors``) that also holds whatever the runner needs to resume from it;
    ``metrics`` are those of the step it holds."""

    path: Path
    metrics: StepMetrics


@dataclass(frozen=True)
class FinishedEvent:
    """Training ended normally; ``adapter_path`` is the final adapter's PEFT directory."""

    adapter_path: Path
    metrics: StepMetrics | None  # None only for a job that ran no optimizer step


@dataclass(frozen=True)
class PausedEvent:
    """A pause completed: a :class:`CheckpointEvent` for ``step`` came first (unless ``step``
    is 0: nothing was trained, the job starts afresh); nothing trains."""

    step: int


@dataclass(frozen=True)
class NoticeEvent:
    """Something a job's owner should read that changes no state: a training step lost and
    retried, a failed write being retried, a validation that did not run."""

    message: str
    level: Literal["info", "warn", "error"] = "warn"


@dataclass(frozen=True)
class FailedEvent:
    """Training stopped on an error; no job is active any more."""

    code: str
    message: str


RunnerEvent = (StepEvent | CheckpointEvent | FinishedEvent | PausedEvent | FailedEvent
               | NoticeEvent)


@runtime_checkable
class TrainingRunner(Protocol):
    """The training side of one host: at most one job at a time. Only the server's job driver
    thread calls it.

    Every event of a job comes out of :meth:`poll` in the order it happened; a job ends with
    exactly one :class:`FinishedEvent`, :class:`PausedEvent` or :class:`FailedEvent`, or with
    :meth:`cancel` returning."""

    defaults: JobDefaults

    def start(self, spec: TrainingJobSpec) -> None:
        """Begin training ``spec`` (returns once it trains; setting up may take seconds).
        Raises ``InputError`` for a spec it cannot train (a sample longer than its buffer, a
        damaged checkpoint, ...) and ``RuntimeError`` if a job is active."""
        ...

    def poll(self) -> list[RunnerEvent]:
        """Events since the last call, oldest first (never blocks)."""
        ...

    def pause(self) -> None:
        """Ask the active job to checkpoint and stop (a CheckpointEvent, then a PausedEvent)."""
        ...

    def cancel(self) -> None:
        """Stop the active job without a checkpoint; returns when it has stopped. Its events
        not yet polled are dropped."""
        ...


# ---- serving statistics ---------------------------------------------------------------------
@dataclass(frozen=True)
class ServingStatsSnapshot:
    """The co-server's counters at one instant. Counts are totals since start-up; times sums.

    ``slo_misses``: requests that missed each objective (keys ``"ttft"``, ``"tpot"``);
    ``requests_slo_missed``: requests that missed either (for the attainment ratio)."""

    ft_tokens_committed: int
    ft_samples_committed: int
    ft_tokens_admitted: int
    admission_skips: Mapping[Skip, int]
    steps: int
    step_time_predicted_s: float
    step_time_measured_s: float
    latency_model_mape: float | None  # online per-step error over the refit window
    slo_misses: Mapping[str, int]
    requests_finished: int
    requests_slo_missed: int
    inference_tokens: int  # output tokens generated for clients
    backward_busy_ratio: float  # fraction of wall time the backward process computed
    # optimizer steps lost, by kind (an exception's class, or "worker_died")
    ft_steps_lost: Mapping[str, int] = field(default_factory=dict)


@runtime_checkable
class ServingStats(Protocol):
    def snapshot(self) -> ServingStatsSnapshot:
        """Thread-safe; cheap enough to call once a second."""
        ...
