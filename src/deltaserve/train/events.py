"""What a co-server tells its listeners (the bench's timelines, the service's job events) and
writes to its training log, one typed event per thing that happened."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class OptimizerStep:
    """Step ``step`` reached the adapter; its samples are committed. ``at_s``:
    ``time.monotonic()`` when the co-server saw it; ``epoch``: the epoch its samples belong to.
    Data parallel: the loss and token counts are this replica's share of the global step (none,
    for an empty share), ``allreduce_s`` the step's gradient all-reduce, waiting on the slowest
    peer included (0 for one replica)."""

    at_s: float
    step: int
    epoch: int
    sample_ids: tuple[int, ...]
    num_tokens: int
    num_loss_tokens: int
    loss: float
    mean_token_accuracy: float
    grad_norm: float
    lr: float
    wall_s: float
    paused_s: float
    validating: bool = False  # a ValidationLoss of this step follows
    allreduce_s: float = 0.0
    # data parallel: every replica's samples of the global step (this one's included)
    group_sample_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ValidationLoss:
    """The held-out loss of the adapter as optimizer step ``step`` left it (that step's
    :class:`OptimizerStep` said ``validating``). ``loss`` None: the validation did not run to
    the end (``error`` says why); every validating step gets exactly one of these."""

    at_s: float
    step: int
    loss: float | None
    num_tokens: int
    mean_token_accuracy: float | None
    error: str | None = None


@dataclass(frozen=True)
class StepLost:
    """Backward step ``step`` did not reach the adapter; its samples went back to the pool."""

    at_s: float
    step: int
    num_samples: int
    reason: str


@dataclass(frozen=True)
class TrainingStopped:
    """Training gave up: ``lost_steps`` optimizer steps in a row were lost, the last for
    ``reason`` (see :mod:`deltaserve.train.lost_steps`), or, where ``cause`` says so, for that
    cause (a data-parallel group that lost a member). The co-server admits no more samples and
    submits no more jobs; inference goes on. Nothing follows it but a checkpoint at close."""

    at_s: float
    reason: str
    lost_steps: int
    cause: str | None = None


@dataclass(frozen=True)
class CheckpointSaved:
    at_s: float
    step: int
    path: str


@dataclass(frozen=True)
class TrainingIOError:
    """A training-side write failed (full disk, I/O error); training waits until it succeeds."""

    at_s: float
    what: str
    error: str


TrainingEvent = (OptimizerStep | ValidationLoss | StepLost | TrainingStopped | CheckpointSaved
                 | TrainingIOError)
Listener = Callable[[TrainingEvent], None]


def log_record(event: TrainingEvent) -> dict[str, object]:
    """The training log's JSON line of an event."""
    return {"event": type(event).__name__, **asdict(event)}


@dataclass(frozen=True)
class CoServeStats:
    """A co-server's counters (tokens and samples over every epoch; those committed include a
    resumed checkpoint's). ``ft_tokens_admitted``: tokens admission put into steps (an aborted
    step's too); ``steps_timed``: steps the latency model had predicted before they ran, with the
    sums of those predictions and of the measured times; ``backward_busy_s``: time the backward
    process computed (grant waits excluded); ``steps_lost``: optimizer steps lost, by kind (an
    exception's class, or ``worker_died``: :func:`deltaserve.train.lost_steps.reason_kind`)."""

    ft_tokens_committed: int
    ft_samples_committed: int
    ft_tokens_forwarded: int
    optimizer_steps: int
    steps_with_ft: int
    aborted_steps: int
    backward_failures: int
    worker_restarts: int
    io_errors: int
    epoch: int
    last_loss: float | None
    skips: dict[str, int]
    ft_tokens_admitted: int = 0
    steps_timed: int = 0
    step_time_predicted_s: float = 0.0
    step_time_measured_s: float = 0.0
    backward_busy_s: float = 0.0
    steps_lost: dict[str, int] = field(default_factory=dict)
