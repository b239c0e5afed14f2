"""The training runner on a real host: one co-server per job, attached to the running host.

* ``start``: the job's co-server is attached with the job's tokenized samples (validation
  samples too) and a :class:`CoServeConfig` made of the server's config and the job's
  hyperparameters; the latency model calibrated at start-up is reused (and keeps refitting).
  ``resume_from`` is authoritative (see :class:`TrainingJobSpec`); without it the job starts
  afresh, whatever its checkpoint directory holds.
* finished: once the pool has committed the last epoch (every sample ``n_epochs`` times), the
  co-server is drained (the owed validation runs), checkpointed and detached; the final
  checkpoint's PEFT directory is the job's model.
* ``pause``: drain, checkpoint, detach (the captured samples are trained, nothing is lost).
* ``cancel``: detach without draining or checkpointing; nothing more trains.
* failed: the co-server gave up training (``TrainingStopped``: every optimizer step lost, see
  :mod:`deltaserve.train.lost_steps`): detached with a checkpoint of its last committed step,
  and the job fails with the reason (``training_failed``); the host keeps serving inference.

Detaching happens on the driver's thread while the host keeps serving: the host lets go of the
co-server between two steps (:meth:`BaseHost.detach`), so inference never waits for training
to wind down. The co-server's counters are production state: :meth:`totals` adds the live
co-server's to those of the jobs before it (the service's ``/metrics`` reads them).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from deltaserve.core.data import TrainingSample
from deltaserve.core.errors import InputError
from deltaserve.core.latency_model import LatencyModel
from deltaserve.model.peft_io import save_adapter
from deltaserve.server.hyperparameters import job_defaults
from deltaserve.server.protocols import (
    FailedEvent,
    FinishedEvent,
    NoticeEvent,
    PausedEvent,
    RunnerEvent,
    TrainingJobSpec,
)
from deltaserve.server.runner_events import EventTranslator
from deltaserve.train.config import CoServeConfig
from deltaserve.train.events import (
    CheckpointSaved,
    CoServeStats,
    Listener,
    OptimizerStep,
    TrainingEvent,
    TrainingStopped,
)
from deltaserve.train.facade import CoServer

log = logging.getLogger("deltaserve.server")


class JobCoServer(Protocol):
    """What the runner reads of a job's co-server: a :class:`CoServer`, or its proxy in
    another process (vLLM's engine process: ``hosts.vllm.service_host.RemoteJob``)."""

    def subscribe(self, listener: Listener) -> None: ...

    def stats(self) -> CoServeStats: ...


class CoServingHost(Protocol):
    """Attach and detach one co-server at a time: a :class:`~deltaserve.hosts.base.BaseHost`,
    or ``hosts.vllm.service_host.EngineJobs`` for vLLM's engine process. ``latency_model``
    None: the host keeps its own."""

    def attach(self, *, dataset: Sequence[TrainingSample], config: CoServeConfig,
               latency_model: LatencyModel | None, progress: bool,
               validation: Sequence[TrainingSample] | None) -> JobCoServer: ...

    def detach(self, *, drain: bool, checkpoint: bool) -> object: ...


@dataclass(frozen=True)
class FineTuningTotals:
    """Co-serving counters since the server started, over every job (a resumed job counts only
    what it trained in this process)."""

    tokens_committed: int = 0
    samples_committed: int = 0
    tokens_admitted: int = 0
    skips: dict[str, int] = field(default_factory=dict)
    steps_timed: int = 0
    step_time_predicted_s: float = 0.0
    step_time_measured_s: float = 0.0
    backward_busy_s: float = 0.0
    steps_lost: dict[str, int] = field(default_factory=dict)  # by kind

    def plus(self, now: CoServeStats, since: CoServeStats) -> FineTuningTotals:
        """These totals plus what a co-server counted between ``since`` and ``now``."""
        skips = Counter(self.skips)
        skips.update({k: v - since.skips.get(k, 0) for k, v in now.skips.items()})
        lost = Counter(self.steps_lost)
        lost.update({k: v - since.steps_lost.get(k, 0) for k, v in now.steps_lost.items()})
        return FineTuningTotals(
            self.tokens_committed + now.ft_tokens_committed - since.ft_tokens_committed,
            self.samples_committed + now.ft_samples_committed - since.ft_samples_committed,
            self.tokens_admitted + now.ft_tokens_admitted - since.ft_tokens_admitted,
            dict(skips), self.steps_timed + now.steps_timed - since.steps_timed,
            self.step_time_predicted_s + now.step_time_predicted_s
            - since.step_time_predicted_s,
            self.step_time_measured_s + now.step_time_measured_s - since.step_time_measured_s,
            self.backward_busy_s + now.backward_busy_s - since.backward_busy_s, dict(lost))


@dataclass(eq=False)
class _Job:
    spec: TrainingJobSpec
    co: JobCoServer
    baseline: CoServeStats  # the co-server's counters when it was attached
    events: EventTranslator
    target_samples: int  # samples committed (every epoch) when the job is done
    samples_done: int
    finished: threading.Event = field(default_factory=threading.Event)
    checkpoint: tuple[int, Path] | None = None  # the newest CheckpointSaved
    stopped: TrainingStopped | None = None  # training gave up: the job fails

    def observe(self, ev: TrainingEvent) -> None:
        """The co-server's listener (on the host's thread; a fault here must not reach it)."""
        try:
            self.events.feed(ev)
            if isinstance(ev, OptimizerStep):
                self.samples_done += len(ev.sample_ids)
                if self.samples_done >= self.target_samples:
                    self.finished.set()
            elif isinstance(ev, CheckpointSaved):
                self.checkpoint = (ev.step, Path(ev.path))
            elif isinstance(ev, TrainingStopped):
                self.stopped = ev
                self.finished.set()
        except Exception:
            log.exception("job %s: could not record a training event", self.spec.job_id)


class CoServingRunner:
    def __init__(self, host: CoServingHost, config: CoServeConfig,
                 latency_model: LatencyModel | None, max_sample_tokens: int):
        self.host = host
        self.config = config
        self.latency = latency_model
        self.defaults = job_defaults(config, max_sample_tokens)
        self._lock = threading.Lock()
        self._job: _Job | None = None
        self._totals = FineTuningTotals()
        self._ready: list[RunnerEvent] = []  # only the driver's thread touches it

    # ---- the TrainingRunner protocol ----------------------------------------------------------
    def start(self, spec: TrainingJobSpec) -> None:
        if self._job is not None:
            raise RuntimeError(f"job {self._job.spec.job_id} is still training")
        require_samples(spec)
        _warn_superseded(spec)
        co = self.host.attach(dataset=list(spec.train_samples), config=self.job_config(spec),
                              latency_model=self.latency, progress=False,
                              validation=list(spec.valid_samples) or None)
        baseline = co.stats()
        job = _Job(spec, co, baseline, EventTranslator(baseline.ft_tokens_committed,
                                                       spec.resume_metrics),
                   spec.hyperparameters.n_epochs * len(spec.train_samples),
                   baseline.ft_samples_committed)
        co.subscribe(job.observe)
        if job.samples_done >= job.target_samples:  # resumed from its final checkpoint
            job.finished.set()
        with self._lock:
            self._job = job
        log.info("job %s: co-serving (%d samples, %d epochs%s)", spec.job_id,
                 len(spec.train_samples), spec.hyperparameters.n_epochs,
                 f", from {spec.resume_from.name}" if spec.resume_from else "")

    def poll(self) -> list[RunnerEvent]:
        job = self._job
        if job is not None:
            if job.stopped is not None:
                self._failed(job, job.stopped)
            elif job.finished.is_set():
                self._finish(job)
            else:
                self._ready += job.events.take()
        out, self._ready = self._ready, []
        return out

    def pause(self) -> None:
        job = self._job
        if job is None:
            return
        self._detach(job, drain=True, checkpoint=True)
        step = job.co.stats().optimizer_steps
        self._ready += job.events.take()
        if step and (job.checkpoint is None or job.checkpoint[0] != step):
            self._ready.append(NoticeEvent(f"Could not checkpoint step {step}; a resume "
                                           "continues from the newest checkpoint listed",
                                           "error"))
        self._ready.append(PausedEvent(step))

    def cancel(self) -> None:
        job = self._job
        if job is None:
            return
        self._detach(job, drain=False, checkpoint=False)
        self._ready.clear()

    # ---- statistics -------------------------------------------------------------------------
    def totals(self) -> FineTuningTotals:
        """Thread-safe: the finished jobs' counters plus the live co-server's."""
        with self._lock:
            job, base = self._job, self._totals
        return base if job is None else base.plus(job.co.stats(), job.baseline)

    # ---- internals --------------------------------------------------------------------------
    def job_config(self, spec: TrainingJobSpec) -> CoServeConfig:
        """The server's co-serving config with the job's hyperparameters, seed and
        checkpoints."""
        hp, c = spec.hyperparameters, self.config
        opt = replace(c.optimizer, lr=hp.learning_rate)
        if opt.schedule != "constant" and opt.total_steps is None:  # decay over the job
            tokens = sum(s.num_tokens for s in spec.train_samples)
            opt = replace(opt, total_steps=hp.n_epochs * math.ceil(
                tokens / hp.backward_batch_tokens))
        resume = spec.resume_from is not None
        ckpt = replace(c.checkpoint, root=str(spec.checkpoint_dir),
                       every_steps=spec.checkpoint_every_steps, resume=resume,
                       resume_from=str(spec.resume_from) if resume else None)
        return replace(c, num_epochs=hp.n_epochs, seed=spec.seed, optimizer=opt,
                       backward=replace(c.backward, batch_tokens=hp.backward_batch_tokens),
                       checkpoint=ckpt)

    def _finish(self, job: _Job) -> None:
        self._detach(job, drain=True, checkpoint=True)
        self._ready += job.events.take()
        step = job.co.stats().optimizer_steps
        try:
            final = self._final_adapter(job, step)
        except OSError as e:
            self._ready.append(FailedEvent("adapter_write_failed", f"training finished at "
                                           f"step {step} but its adapter was not written: {e}"))
            return
        self._ready.append(FinishedEvent(final, job.events.last_metrics))

    def _failed(self, job: _Job, ev: TrainingStopped) -> None:
        self._detach(job, drain=False, checkpoint=True)
        self._ready += job.events.take()
        log.error("job %s: training failed: %s", job.spec.job_id, ev.reason)
        why = ev.cause or (f"{ev.lost_steps} optimizer steps in a row were lost (none reached "
                           f"the adapter)")
        self._ready.append(FailedEvent("training_failed", f"training stopped: {why}: "
                                       f"{ev.reason}"))

    def _final_adapter(self, job: _Job, step: int) -> Path:
        """The final checkpoint's PEFT directory; written separately if that checkpoint
        failed (a full disk then raises ``OSError``)."""
        if job.checkpoint is not None and job.checkpoint[0] == step:
            return job.checkpoint[1]
        if not isinstance(job.co, CoServer):  # in another process: only its checkpoints
            raise OSError(f"the final checkpoint (step {step}) was not written")
        return save_adapter(job.spec.checkpoint_dir / "final", job.co.adapter,
                            job.spec.base_model)

    def _detach(self, job: _Job, *, drain: bool, checkpoint: bool) -> None:
        """Detach from the host (which keeps serving) and fold the job's counters in."""
        try:
            self.host.detach(drain=drain, checkpoint=checkpoint)
        except Exception:  # a hung backward: what it had not committed trains again later
            log.exception("job %s: detaching the co-server failed", job.spec.job_id)
        with self._lock:
            self._totals = self._totals.plus(job.co.stats(), job.baseline)
            self._job = None


def require_samples(spec: TrainingJobSpec) -> None:
    if not spec.train_samples:
        raise InputError("training_file", 0, "no sample to train on")


def _warn_superseded(spec: TrainingJobSpec) -> None:
    """Say so when the job's directory holds checkpoints newer than the one it resumes from
    (written, then the server died before recording them): their steps train again."""
    start = int(spec.resume_from.name.split("-")[-1]) if spec.resume_from else 0
    root = spec.checkpoint_dir
    newer = sorted(p.name for p in root.glob("checkpoint-*")
                   if p.name.split("-")[-1].isdigit() and int(p.name.split("-")[-1]) > start
                   ) if root.is_dir() else []
    if newer:
        log.warning("job %s: %s written after %s but never recorded; resuming from %s, "
                    "those steps train again", spec.job_id, ", ".join(newer),
                    spec.resume_from.name if spec.resume_from else "the start",
                    spec.resume_from.name if spec.resume_from else "the start")
