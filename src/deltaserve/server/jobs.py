"""Fine-tuning jobs as clients drive them: create (then validate the files in the background),
cancel, pause, resume. The job driver thread does the training; this side only records what a
client asked for and hands the running job's commands to the driver."""

from __future__ import annotations

import asyncio
import logging
import secrets
from concurrent.futures import Future, ThreadPoolExecutor

from deltaserve.core.errors import InputError
from deltaserve.server.data_dir import DataDir, is_id
from deltaserve.server.db_records import (
    FILE_PREFIX,
    JOB_PREFIX,
    JobError,
    JobRecord,
    JobStatus,
    new_id,
)
from deltaserve.server.driver import JobDriver
from deltaserve.server.errors import APIError, from_input_error, not_found
from deltaserve.server.events import EventSink
from deltaserve.server.hyperparameters import Hyperparameters, resolve
from deltaserve.server.job_data import JobDataError, describe, load_job_data
from deltaserve.server.protocols import InferenceBackend
from deltaserve.server.schemas_ft import JobCreate
from deltaserve.server.store import Store, now_s

log = logging.getLogger("deltaserve.server")
COMMAND_TIMEOUT_S = 60.0  # a cancel or pause answers at the latest then, with the job as it is


class JobService:
    def __init__(self, store: Store, data_dir: DataDir, backend: InferenceBackend,
                 driver: JobDriver, sink: EventSink):
        self.store = store
        self.data_dir = data_dir
        self.backend = backend
        self.driver = driver
        self.sink = sink
        # one validation at a time: tokenizing shares the CPU with serving
        self._validator = ThreadPoolExecutor(1, thread_name_prefix="deltaserve-validate")

    def start(self) -> None:
        """Validate again the jobs a restart interrupted in ``validating_files``."""
        for job in self.store.jobs_with_status(JobStatus.VALIDATING_FILES):
            self._validator.submit(self._validate, job)

    def close(self) -> None:
        self._validator.shutdown(wait=False, cancel_futures=True)

    def get(self, job_id: str) -> JobRecord:
        job = self.store.get_job(job_id) if is_id(JOB_PREFIX, job_id) else None
        if job is None:
            raise not_found("fine-tuning job", job_id, "fine_tuning_job_id")
        return job

    # ---- create -----------------------------------------------------------------------------
    def create(self, req: JobCreate) -> JobRecord:
        if req.model != self.backend.model_name:
            raise APIError(400, f"Model {req.model} is not available for fine-tuning or does not"
                           f" exist; this server fine-tunes {self.backend.model_name}",
                           param="model", code="model_not_available")
        for param, file_id in (("training_file", req.training_file),
                               ("validation_file", req.validation_file)):
            if file_id is not None and (not is_id(FILE_PREFIX, file_id)
                                        or self.store.get_file(file_id) is None):
                raise not_found("file", file_id, param)
        try:
            hp = Hyperparameters(**req.requested_hyperparameters().model_dump())
        except InputError as e:
            raise from_input_error(e) from None
        job = JobRecord(
            id=new_id(JOB_PREFIX), created_at=now_s(), model=req.model,
            training_file=req.training_file, validation_file=req.validation_file,
            status=JobStatus.VALIDATING_FILES, hyperparameters=hp, suffix=req.suffix,
            seed=req.seed if req.seed is not None else secrets.randbelow(2**31),
            metadata=req.metadata, queue_seq=0)
        job = self.store.add_job(job)
        self.sink.message(job.id, f"Validating training file: {job.training_file}"
                          + (f" and validation file: {job.validation_file}"
                             if job.validation_file else ""), state=True)
        self._validator.submit(self._validate, job)
        return job

    def _validate(self, job: JobRecord) -> None:
        """Parse and tokenize the files, resolve the hyperparameters, then queue the job."""
        try:
            data = load_job_data(self.data_dir, self.backend, job,
                                 self.driver.runner.defaults.max_sample_tokens)
        except JobDataError as e:
            self._fail(job, e.error)
            return
        except Exception as e:
            log.exception("job %s: validation failed", job.id)
            self._fail(job, JobError("internal_error", f"validation failed: {e}"))
            return
        if not data.train:
            self._fail(job, JobError("invalid_training_file", describe(
                data.train_report, job.training_file) + ": no sample left to train on",
                "training_file"))
            return
        reported, training = resolve(job.hyperparameters, data.train, self.driver.runner.defaults)
        self.store.set_resolved(job.id, reported, training)
        self.sink.message(job.id, describe(data.train_report, job.training_file))
        if data.valid_report is not None and job.validation_file is not None:
            self.sink.message(job.id, describe(data.valid_report, job.validation_file))
        if self.store.set_status(job.id, JobStatus.QUEUED, expect=(JobStatus.VALIDATING_FILES,)):
            self.sink.message(job.id, "Files validated, moving job to queued state", state=True)
            self.driver.wake()

    def _fail(self, job: JobRecord, error: JobError) -> None:
        # only a job still validating: one cancelled meanwhile stays cancelled
        if self.store.set_failed(job.id, error, expect=(JobStatus.VALIDATING_FILES,)):
            self.sink.message(job.id, f"Job failed: {error.message}", level="error")

    # ---- control ----------------------------------------------------------------------------
    async def command(self, kind: str, job_id: str) -> JobRecord:
        """Cancel or pause through the driver, which owns the running job."""
        job = self.get(job_id)
        done: Future = self.driver.submit(kind, job.id)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(done), COMMAND_TIMEOUT_S)
        except TimeoutError:
            return self.get(job_id)

    def resume(self, job_id: str) -> JobRecord:
        job = self.get(job_id)
        if not self.store.set_status(job.id, JobStatus.QUEUED, expect=(JobStatus.PAUSED,),
                                     requeue=True):
            raise APIError(400, f"job {job.id} is {self.get(job_id).status.value}; only a "
                           "paused job can be resumed", param="fine_tuning_job_id",
                           code="invalid_state")
        self.sink.message(job.id, "Job resumed: queued to continue from its newest checkpoint",
                          state=True)
        self.driver.wake()
        return self.get(job.id)
