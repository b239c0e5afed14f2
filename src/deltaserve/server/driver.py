"""The job driver: one thread that owns the training runner.

It takes queued jobs in FIFO order, one at a time, starts each on the runner (from its newest
checkpoint when it had one), turns the runner's events into the job's state, events,
checkpoints and servable adapters, and carries out cancel and pause. Only this thread calls the
runner, so a command never races a job's own progress. A fault in one job fails that job; the
thread itself, and inference, go on.

Shutdown: the running job is checkpointed and left ``paused`` (a client resumes it). If the
checkpoint does not land within ``shutdown_pause_timeout_s``, the job stays ``running`` in the
store and is resumed from its newest checkpoint at the next start-up, like after a crash.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

from deltaserve.core.errors import InputError
from deltaserve.server.config import ServerConfig
from deltaserve.server.data_dir import DataDir
from deltaserve.server.db_records import CheckpointRecord, JobError, JobRecord, JobStatus
from deltaserve.server.errors import APIError
from deltaserve.server.events import EventSink
from deltaserve.server.job_data import JobDataError, load_job_data
from deltaserve.server.model_registry import ModelRegistry, fine_tuned_model_name
from deltaserve.server.protocols import (
    CheckpointEvent,
    FailedEvent,
    FinishedEvent,
    InferenceBackend,
    NoticeEvent,
    PausedEvent,
    RunnerEvent,
    StepEvent,
    TrainingJobSpec,
    TrainingRunner,
)
from deltaserve.server.store import Store

log = logging.getLogger("deltaserve.server")


@dataclass(frozen=True)
class Command:
    kind: Literal["cancel", "pause"]
    job_id: str
    done: Future  # of the JobRecord after the command took effect


@dataclass
class _Active:
    job: JobRecord
    waiters: list[Future]  # pause commands waiting for the checkpoint


class JobDriver:
    def __init__(self, config: ServerConfig, store: Store, data_dir: DataDir,
                 backend: InferenceBackend, runner: TrainingRunner, models: ModelRegistry,
                 sink: EventSink):
        self.config = config
        self.store = store
        self.data_dir = data_dir
        self.backend = backend
        self.runner = runner
        self.sink = sink
        self._commands: queue.Queue[Command] = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._active: _Active | None = None
        self._thread = threading.Thread(target=self._run, name="deltaserve-jobs", daemon=True)
        self._models = models

    # ---- called from other threads ----------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, kind: Literal["cancel", "pause"], job_id: str) -> Future:
        cmd = Command(kind, job_id, Future())
        self._commands.put(cmd)
        self.wake()
        return cmd.done

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        """Checkpoint and pause the running job, then end the thread."""
        self._stop.set()
        self.wake()
        self._thread.join(self.config.shutdown_pause_timeout_s + 10.0)

    # ---- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                self._drain_commands()
                if self._active is not None:
                    self._handle(self.runner.poll())
                if self._stop.is_set():
                    break
                if self._active is None:
                    self._start_next()
            except Exception:  # a bug or an I/O fault must not end the driver
                log.exception("job driver: unexpected error")
                time.sleep(1.0)
            self._wake.wait(self.config.job_poll_interval_s)
            self._wake.clear()
        self._shutdown_active()

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                self._execute(cmd)
            except Exception as e:  # the client gets the error; the driver goes on
                if not isinstance(e, APIError):
                    log.exception("job %s: %s failed", cmd.job_id, cmd.kind)
                if not cmd.done.done():
                    cmd.done.set_exception(e)

    def _execute(self, cmd: Command) -> None:
        active = self._active
        if active is not None and active.job.id == cmd.job_id:
            if cmd.kind == "cancel":
                self.runner.cancel()
                self._finish(active, JobStatus.CANCELLED, "Job cancelled")
                cmd.done.set_result(self.store.get_job(cmd.job_id))
            else:
                if not active.waiters:
                    self.runner.pause()
                    self.sink.message(cmd.job_id, "Pausing: writing a checkpoint")
                active.waiters.append(cmd.done)
            return
        if cmd.kind == "cancel":
            movable = (JobStatus.VALIDATING_FILES, JobStatus.QUEUED, JobStatus.PAUSED)
            target, message = JobStatus.CANCELLED, "Job cancelled"
        else:
            movable, target, message = (JobStatus.QUEUED,), JobStatus.PAUSED, "Job paused"
        if self.store.set_status(cmd.job_id, target, expect=movable):
            self.sink.message(cmd.job_id, message, state=True)
            cmd.done.set_result(self.store.get_job(cmd.job_id))
            return
        job = self.store.get_job(cmd.job_id)
        status = job.status.value if job else "unknown"
        raise APIError(400, f"job {cmd.job_id} is {status}; it cannot be {cmd.kind}led"
                       if cmd.kind == "cancel" else
                       f"job {cmd.job_id} is {status}; only a running or queued job can be "
                       "paused", param="fine_tuning_job_id", code="invalid_state")

    # ---- starting a job ---------------------------------------------------------------------
    def _next_job(self) -> JobRecord | None:
        """A job left ``running`` by a crash first, then the queue in order."""
        for status in (JobStatus.RUNNING, JobStatus.QUEUED):
            jobs = self.store.jobs_with_status(status)
            if jobs:
                return jobs[0]
        return None

    def _start_next(self) -> None:
        job = self._next_job()
        if job is None:
            return
        after_crash = job.status is JobStatus.RUNNING
        if not after_crash and not self.store.set_status(job.id, JobStatus.RUNNING,
                                                         expect=(JobStatus.QUEUED,)):
            return  # cancelled or paused in between
        try:
            spec = self._spec(job, after_crash)
            self.runner.start(spec)
        except JobDataError as e:
            self._fail(job, e.error)
            return
        except InputError as e:  # the data, or a checkpoint to resume from, cannot train
            code, param = (("checkpoint_unusable", None) if e.field.startswith("checkpoint")
                           else ("invalid_training_file", "training_file"))
            self._fail(job, JobError(code, str(e), param))
            return
        except Exception as e:
            log.exception("job %s: could not start", job.id)
            self._fail(job, JobError("internal_error", f"could not start: {e}"))
            return
        self._active = _Active(job, [])

    def _resume_point(self, job: JobRecord) -> CheckpointRecord | None:
        """The newest recorded checkpoint still on disk (the runner prunes old ones)."""
        for ckpt in self.store.list_checkpoints(job.id, None, 1000).data:
            if ckpt.runner_path.is_dir():
                return ckpt
            log.warning("job %s: checkpoint %s is gone", job.id, ckpt.runner_path)
        return None

    def _spec(self, job: JobRecord, after_crash: bool) -> TrainingJobSpec:
        data = load_job_data(self.data_dir, self.backend, job,
                             self.runner.defaults.max_sample_tokens)
        if job.training is None:
            raise JobDataError(JobError("internal_error", "the job was never validated"))
        ckpt = self._resume_point(job)
        step = ckpt.step if ckpt else 0
        dropped = self.store.drop_metrics_after(job.id, step)
        self.store.set_trained_tokens(job.id, ckpt.metrics.trained_tokens if ckpt else 0)
        if ckpt is None:
            note = "Fine-tuning job started"
        else:
            note = f"Fine-tuning job resumed from its checkpoint at step {step}"
            if dropped:
                note += f" (the {dropped} steps after it train again)"
        if after_crash:
            note = "The server restarted while the job ran. " + note
        self.sink.message(job.id, note, state=True)
        return TrainingJobSpec(
            job_id=job.id, base_model=job.model, train_samples=data.train,
            valid_samples=data.valid, hyperparameters=job.training, seed=job.seed,
            checkpoint_dir=self.data_dir.checkpoints(job.id),
            checkpoint_every_steps=self.config.checkpoint_every_steps,
            resume_from=ckpt.runner_path if ckpt else None,
            resume_metrics=ckpt.metrics if ckpt else None)

    # ---- the runner's events ----------------------------------------------------------------
    def _handle(self, events: list[RunnerEvent]) -> None:
        for ev in events:
            active = self._active
            if active is None:
                return
            job_id = active.job.id
            if isinstance(ev, StepEvent):
                self.sink.step(job_id, ev.metrics)
            elif isinstance(ev, CheckpointEvent):
                self._checkpoint(active.job, ev)
            elif isinstance(ev, FinishedEvent):
                self._succeed(active, ev)
            elif isinstance(ev, PausedEvent):
                self._finish(active, JobStatus.PAUSED,
                             f"Job paused at step {ev.step}; resume it to continue")
            elif isinstance(ev, FailedEvent):
                self._fail(active.job, JobError(ev.code, ev.message))
                self._release(active)
            elif isinstance(ev, NoticeEvent):
                self.sink.message(job_id, ev.message, level=ev.level)

    def _checkpoint(self, job: JobRecord, ev: CheckpointEvent) -> None:
        name = fine_tuned_model_name(job.model, job.suffix, job.id)
        try:
            rec = self.sink.checkpoint(job.id, name, ev)
        except OSError as e:  # the runner keeps its own copy; training goes on
            log.exception("job %s: could not store checkpoint step %d", job.id, ev.metrics.step)
            self.sink.message(job.id, f"Checkpoint at step {ev.metrics.step} not stored: {e}",
                              level="warn")
            return
        self._models.register(rec.adapter)

    def _succeed(self, active: _Active, ev: FinishedEvent) -> None:
        job = active.job
        name = fine_tuned_model_name(job.model, job.suffix, job.id)
        try:
            adapter = self.sink.final_adapter(job.id, name, ev)
            # Usable by name before any client can see the job succeeded.
            self._models.register(adapter)
            self.sink.succeeded(job.id, name, adapter, ev)
        except Exception as e:
            log.exception("job %s: could not store or load the final adapter", job.id)
            self._fail(job, JobError("adapter_store_failed",
                                     f"training finished but its adapter ({ev.adapter_path}) "
                                     f"could not be stored or served: {e}"))
        self._release(active)

    def _finish(self, active: _Active, status: JobStatus, message: str) -> None:
        self.store.set_status(active.job.id, status)
        self.sink.message(active.job.id, message, state=True)
        self._release(active)

    def _fail(self, job: JobRecord, error: JobError) -> None:
        self.store.set_failed(job.id, error)
        self.sink.message(job.id, f"Job failed: {error.message}", level="error", state=True)

    def _release(self, active: _Active) -> None:
        """The job no longer trains: answer waiting pauses, free the runner for the next."""
        now = self.store.get_job(active.job.id)
        for w in active.waiters:
            w.set_result(now)
        self._active = None
        self.sink.forget(active.job.id)

    def _shutdown_active(self) -> None:
        active = self._active
        if active is None:
            return
        log.info("shutting down: pausing job %s (checkpoint first)", active.job.id)
        if not active.waiters:
            self.runner.pause()
        deadline = time.monotonic() + self.config.shutdown_pause_timeout_s
        while self._active is not None and time.monotonic() < deadline:
            self._handle(self.runner.poll())
            time.sleep(self.config.job_poll_interval_s)
        if self._active is not None:
            log.warning("job %s did not checkpoint within %.0f s; it resumes from its newest "
                        "checkpoint at the next start", active.job.id,
                        self.config.shutdown_pause_timeout_s)
            self.runner.cancel()
            self._active = None
