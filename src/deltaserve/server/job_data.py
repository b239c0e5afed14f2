"""A job's training and validation files, tokenized with the served model's tokenizer.

Done twice per job: when it is validated (``validating_files``: every record parsed and
tokenized, hyperparameters resolved from the real sample lengths) and again when it starts (or
resumes after a restart), so nothing but the uploaded file has to be kept."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.core.data import DataConfig, DatasetReport, TrainingSample, load_dataset
from deltaserve.core.errors import InputError
from deltaserve.server.data_dir import DataDir
from deltaserve.server.db_records import JobError, JobRecord
from deltaserve.server.protocols import InferenceBackend


@dataclass(frozen=True)
class JobData:
    train: tuple[TrainingSample, ...]
    valid: tuple[TrainingSample, ...]
    train_report: DatasetReport
    valid_report: DatasetReport | None


class JobDataError(Exception):
    def __init__(self, error: JobError):
        super().__init__(error.message)
        self.error = error


def _load(data_dir: DataDir, backend: InferenceBackend, file_id: str, param: str,
          max_tokens: int) -> tuple[list[TrainingSample], DatasetReport]:
    path = data_dir.file(file_id)
    if not path.is_file():
        raise JobDataError(JobError(f"invalid_{param}", f"{param} {file_id} no longer exists",
                                    param))
    # A sample can be no longer than the runner takes; longer ones are dropped and counted.
    cfg = DataConfig(path=str(path), max_tokens=max_tokens)
    try:
        return load_dataset(cfg, backend.tokenizer)
    except InputError as e:
        message = str(e).replace(str(path), file_id)
        raise JobDataError(JobError(f"invalid_{param}", f"{file_id}: {message}", param)
                           ) from None
    except UnicodeDecodeError as e:
        raise JobDataError(JobError(f"invalid_{param}", f"{file_id}: not UTF-8 ({e.reason})",
                                    param)) from None


def load_job_data(data_dir: DataDir, backend: InferenceBackend, job: JobRecord,
                  max_tokens: int) -> JobData:
    """Samples of at most ``max_tokens`` tokens. Raises :class:`JobDataError` with OpenAI's
    error fields for a file that cannot train."""
    train, train_report = _load(data_dir, backend, job.training_file, "training_file",
                                max_tokens)
    valid: list[TrainingSample] = []
    valid_report = None
    if job.validation_file is not None:
        valid, valid_report = _load(data_dir, backend, job.validation_file, "validation_file",
                                    max_tokens)
    return JobData(tuple(train), tuple(valid), train_report, valid_report)


def describe(report: DatasetReport, file_id: str) -> str:
    """One event line: what the loader kept and what it set aside."""
    text = f"{file_id}: {report.num_samples} samples, {report.num_tokens} tokens"
    if report.num_dropped_overlength:
        text += f", {report.num_dropped_overlength} longer than the context dropped"
    if report.num_dropped_no_loss:
        text += f", {report.num_dropped_no_loss} without response tokens dropped"
    return text
