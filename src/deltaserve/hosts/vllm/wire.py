"""What crosses between vLLM's API-server process and its engine process for the fine-tuning
service (``deltaserve serve --engine vllm`` without ``--finetune-dataset``): typed dataclasses as
plain JSON (:mod:`deltaserve.core.config_io`), through the worker extension's RPCs.

* :class:`CalibrateSpec`: once at start-up, the latency model every job reuses;
* :class:`JobStart`: one job's samples and co-serving config;
* :class:`JobPoll`: the engine side's state, the co-server's counters and the training events
  since the last poll (:class:`WireEvent`, one :data:`~deltaserve.train.events.TrainingEvent`
  each, in the order the co-server emitted them).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from deltaserve.core.config_io import JSONValue, from_dict, to_dict
from deltaserve.core.data import TrainingSample
from deltaserve.core.errors import InputError, require_choice
from deltaserve.train.config import CoServeConfig
from deltaserve.train.events import (
    CheckpointSaved,
    CoServeStats,
    OptimizerStep,
    StepLost,
    TrainingEvent,
    TrainingIOError,
    TrainingStopped,
    ValidationLoss,
)

CALIBRATIONS = ("quick", "full")
_EVENTS: dict[str, type[TrainingEvent]] = {
    cls.__name__: cls
    for cls in (OptimizerStep, ValidationLoss, StepLost, TrainingStopped, CheckpointSaved,
                TrainingIOError)}


class State(StrEnum):
    DETACHED = "detached"  # nothing calibrated, nothing attached
    CALIBRATING = "calibrating"
    READY = "ready"  # calibrated, no co-server attached: a job may start
    COSERVING = "coserving"
    FAILED = "failed"


@dataclass(frozen=True)
class RemoteStatus:
    """Co-serving in the engine process, as the API server polls it."""

    state: State = State.DETACHED
    samples: int = 0
    max_ft_tokens_per_step: int | None = None
    calibration_points: int = 0
    optimizer_steps: int = 0
    ft_tokens_committed: int = 0
    checkpoint: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class CalibrateSpec:
    """The service's start-up: calibrate the engine (``quick`` or ``full`` sweep, for the
    adapter shape ``coserve.lora``) unless ``latency_model`` (a fitted model's JSON) is given."""

    coserve: CoServeConfig
    calibration: str = "quick"
    latency_model: str | None = None

    def __post_init__(self) -> None:
        require_choice("finetune_calibration", self.calibration, CALIBRATIONS)


@dataclass(frozen=True)
class JobStart:
    """One job: its co-serving config (checkpoint root, resume point, hyperparameters) and its
    tokenized training and validation samples."""

    config: CoServeConfig
    samples: tuple[TrainingSample, ...]
    validation: tuple[TrainingSample, ...] = ()


@dataclass(frozen=True)
class WireEvent:
    kind: str  # the TrainingEvent's class name
    data: dict[str, JSONValue]


@dataclass(frozen=True)
class JobPoll:
    status: RemoteStatus
    stats: CoServeStats | None  # None while no co-server is attached
    events: tuple[WireEvent, ...] = ()


def encode_event(event: TrainingEvent) -> WireEvent:
    return WireEvent(type(event).__name__, to_dict(event))


def decode_event(wire: WireEvent) -> TrainingEvent:
    cls = _EVENTS.get(wire.kind)
    if cls is None:
        raise InputError("kind", wire.kind, f"not a training event; known: {', '.join(_EVENTS)}")
    return from_dict(cls, wire.data)
