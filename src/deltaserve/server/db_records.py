"""The service's typed state: what the SQLite store holds, one dataclass per table."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from deltaserve.server.hyperparameters import Hyperparameters
from deltaserve.server.protocols import StepMetrics, TrainingHyperparameters


class JobStatus(StrEnum):
    """``validating_files → queued → running → succeeded | failed | cancelled``; ``running ⇄
    paused`` (a resumed job queues again)."""

    VALIDATING_FILES = "validating_files"
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


def new_id(prefix: str) -> str:
    """An opaque id: a fixed prefix and 24 random hex digits (never derived from input)."""
    return f"{prefix}{secrets.token_hex(12)}"


FILE_PREFIX = "file-"
JOB_PREFIX = "ftjob-"
CHECKPOINT_PREFIX = "ftckpt_"
EVENT_PREFIX = "ftevent-"


@dataclass(frozen=True)
class FileRecord:
    id: str
    filename: str  # as the client named it: shown, never used in a path
    purpose: str
    bytes: int
    created_at: int
    num_records: int


@dataclass(frozen=True)
class JobError:
    code: str
    message: str
    param: str | None = None


@dataclass(frozen=True)
class JobRecord:
    id: str
    created_at: int
    model: str
    training_file: str
    validation_file: str | None
    status: JobStatus
    hyperparameters: Hyperparameters
    suffix: str | None
    seed: int
    metadata: dict[str, str] | None
    queue_seq: int  # FIFO position: set at creation and again at resume
    training: TrainingHyperparameters | None = None  # resolved once the files are validated
    fine_tuned_model: str | None = None
    finished_at: int | None = None
    trained_tokens: int | None = None
    error: JobError | None = None


@dataclass(frozen=True)
class EventRecord:
    seq: int
    job_id: str
    created_at: int
    level: str  # info | warn | error
    type: str  # message | metrics
    message: str
    metrics: StepMetrics | None

    @property
    def id(self) -> str:
        return f"{EVENT_PREFIX}{self.seq:012d}"


@dataclass(frozen=True)
class CheckpointRecord:
    """``runner_path``: where the runner keeps it (resume state included); ``adapter_dir``: the
    PEFT copy in the server's adapter store, served as ``model_name``."""

    id: str
    job_id: str
    created_at: int
    metrics: StepMetrics
    runner_path: Path
    adapter_dir: Path
    model_name: str

    @property
    def step(self) -> int:
        return self.metrics.step

    @property
    def adapter(self) -> AdapterRecord:
        return AdapterRecord(self.model_name, self.job_id, self.adapter_dir, self.created_at)


@dataclass(frozen=True)
class AdapterRecord:
    """A servable adapter: a succeeded job's model or one of its checkpoints."""

    model_name: str
    job_id: str
    adapter_dir: Path
    created_at: int
