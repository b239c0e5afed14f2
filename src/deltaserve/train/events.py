"""What a co-server tells its listeners (the bench's timelines, the service's job events) and
writes to its training log, one typed event per thing that happened."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class OptimizerStep:
    """Step ``step`` reached the adapter; its samples are committed. ``at_s``:
    ``time.monotonic()`` when the co-server saw it; ``epoch``: the epoch its samples belong to."""

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


@dataclass(frozen=True)
class StepLost:
    """Backward step ``step`` did not reach the adapter; its samples went back to the pool."""

    at_s: float
    step: int
    num_samples: int
    reason: str


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


TrainingEvent = OptimizerStep | StepLost | CheckpointSaved | TrainingIOError
Listener = Callable[[TrainingEvent], None]


def log_record(event: TrainingEvent) -> dict[str, object]:
    """The training log's JSON line of an event."""
    return {"event": type(event).__name__, **asdict(event)}


@dataclass(frozen=True)
class CoServeStats:
    """A co-server's counters (tokens and samples over every epoch)."""

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
