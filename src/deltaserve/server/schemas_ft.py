"""Request and response bodies of the Files and Fine-tuning Jobs APIs, with OpenAI's fields, and
the functions that render the store's records as them."""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deltaserve.server.db_records import (
    CheckpointRecord,
    EventRecord,
    FileRecord,
    JobRecord,
    JobStatus,
)

SUFFIX_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"  # no ':', the separator of model names


class HyperparametersIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n_epochs: Literal["auto"] | int = "auto"
    learning_rate_multiplier: Literal["auto"] | float = "auto"
    batch_size: Literal["auto"] | int = "auto"


class SupervisedIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hyperparameters: HyperparametersIn | None = None


class MethodIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["supervised"]
    supervised: SupervisedIn | None = None


class JobCreate(BaseModel):
    """``POST /v1/fine_tuning/jobs``. Unknown fields are refused (400 naming them) rather than
    ignored, so a knob this server does not implement never silently does nothing."""

    model_config = ConfigDict(extra="forbid")
    model: str
    training_file: str
    validation_file: str | None = None
    hyperparameters: HyperparametersIn | None = None
    method: MethodIn | None = None
    suffix: str | None = Field(default=None, pattern=SUFFIX_PATTERN)
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    metadata: dict[str, str] | None = None
    integrations: list[dict] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None:
            if len(v) > 16:
                raise ValueError("at most 16 keys")
            if any(len(k) > 64 or len(x) > 512 for k, x in v.items()):
                raise ValueError("keys at most 64 characters, values at most 512")
        return v

    @field_validator("integrations")
    @classmethod
    def _integrations(cls, v: list[dict] | None) -> list[dict] | None:
        if v:
            raise ValueError("integrations are not supported by this server")
        return v

    def requested_hyperparameters(self) -> HyperparametersIn:
        if self.method is not None and self.method.supervised is not None \
                and self.method.supervised.hyperparameters is not None:
            return self.method.supervised.hyperparameters
        return self.hyperparameters or HyperparametersIn()


# ---- responses ------------------------------------------------------------------------------
T = TypeVar("T")


class ListObject(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"
    status_details: str | None = None
    expires_at: int | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class JobErrorOut(BaseModel):
    code: str
    message: str
    param: str | None = None


class HyperparametersOut(BaseModel):
    n_epochs: Literal["auto"] | int
    learning_rate_multiplier: Literal["auto"] | float
    batch_size: Literal["auto"] | int


class SupervisedOut(BaseModel):
    hyperparameters: HyperparametersOut


class MethodOut(BaseModel):
    type: Literal["supervised"] = "supervised"
    supervised: SupervisedOut


class FineTuningJob(BaseModel):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    model: str
    status: JobStatus
    training_file: str
    validation_file: str | None
    hyperparameters: HyperparametersOut
    method: MethodOut
    fine_tuned_model: str | None
    finished_at: int | None
    trained_tokens: int | None
    error: JobErrorOut | None
    seed: int
    suffix: str | None
    metadata: dict[str, str] | None
    organization_id: str = "deltaserve"
    result_files: list[str] = Field(default_factory=list)
    estimated_finish: int | None = None
    integrations: list[dict] = Field(default_factory=list)


class JobEvent(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: str
    message: str
    type: Literal["message", "metrics"]
    data: dict | None = None


class JobCheckpoint(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    step_number: int
    metrics: dict[str, float]


def file_object(f: FileRecord) -> FileObject:
    return FileObject(id=f.id, bytes=f.bytes, created_at=f.created_at, filename=f.filename,
                      purpose=f.purpose)


def job_object(j: JobRecord) -> FineTuningJob:
    hp = HyperparametersOut(**j.hyperparameters.as_dict())
    err = JobErrorOut(code=j.error.code, message=j.error.message, param=j.error.param) \
        if j.error else None
    return FineTuningJob(
        id=j.id, created_at=j.created_at, model=j.model, status=j.status,
        training_file=j.training_file, validation_file=j.validation_file, hyperparameters=hp,
        method=MethodOut(supervised=SupervisedOut(hyperparameters=hp)),
        fine_tuned_model=j.fine_tuned_model, finished_at=j.finished_at,
        trained_tokens=j.trained_tokens, error=err, seed=j.seed, suffix=j.suffix,
        metadata=j.metadata)


def event_object(e: EventRecord) -> JobEvent:
    data = None
    if e.metrics is not None:
        m = e.metrics
        data = {"step": m.step, "train_loss": m.train_loss,
                "train_mean_token_accuracy": m.train_mean_token_accuracy}
        if m.valid_loss is not None:
            data["valid_loss"] = m.valid_loss
    return JobEvent(id=e.id, created_at=e.created_at, level=e.level, message=e.message,
                    type="metrics" if e.metrics else "message", data=data)


def checkpoint_object(c: CheckpointRecord) -> JobCheckpoint:
    m = c.metrics
    metrics = {"step": float(m.step), "train_loss": m.train_loss,
               "train_mean_token_accuracy": m.train_mean_token_accuracy}
    if m.valid_loss is not None:
        metrics["valid_loss"] = m.valid_loss
    return JobCheckpoint(id=c.id, created_at=c.created_at,
                         fine_tuned_model_checkpoint=c.model_name, fine_tuning_job_id=c.job_id,
                         step_number=c.step, metrics=metrics)


def page_of(items: list, has_more: bool) -> ListObject:
    return ListObject(data=items, has_more=has_more,
                      first_id=items[0].id if items else None,
                      last_id=items[-1].id if items else None)
