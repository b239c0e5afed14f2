"""The simulated training half of a co-server: a
:class:`~deltaserve.train.trainer_protocol.CoTrainer` whose backward is a timed stand-in on the
simulated device (:mod:`deltaserve.hosts.sim.device`).

Everything above it is the real co-server (:class:`deltaserve.train.facade.CoServer`):
admission, the sample book, the grant around host steps. What this replaces is only what
computes: captures write nothing (no tensors), the backward job's time comes from
:class:`~deltaserve.hosts.sim.backward.BackwardModel` with the oracle's per-step noise, and its
completion is when the simulated device says so. A committed job commits its samples in the
book exactly as the real trainer does, and announces an
:class:`~deltaserve.train.events.OptimizerStep` stamped with simulated time (loss, accuracy and
gradient norm are NaN: nothing is computed). Nothing is written to disk.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from dataclasses import dataclass, replace

from deltaserve.core.admission import AdmissionPlan
from deltaserve.core.contract import TrainingRows
from deltaserve.core.errors import require
from deltaserve.core.shape import StepShape
from deltaserve.hosts.sim.backward import BackwardCost, BackwardJob
from deltaserve.hosts.sim.clock import SimClock
from deltaserve.hosts.sim.device import GpuTimeline, JobTiming
from deltaserve.hosts.sim.oracle import StepNoise
from deltaserve.train.backward.messages import JobSample
from deltaserve.train.config import CoServeConfig, GrantPolicy
from deltaserve.train.events import Listener, OptimizerStep, TrainingEvent
from deltaserve.train.samples import SampleBook
from deltaserve.train.trainer_protocol import GrantDelegation

NAN = math.nan


@dataclass(frozen=True, eq=False)
class SimStep:
    """:class:`~deltaserve.core.contract.TrainingStep` of a simulated forward: no tensors, so
    the captures are never called with any; the abort flag is the co-server's real one."""

    plan: AdmissionPlan
    rows: TrainingRows
    abortable: bool
    abort: threading.Event
    saves_mlp: bool = False

    def capture(self, layer: int, hidden: object) -> None:
        """A simulated forward computes no activations: nothing to keep."""

    def capture_mlp(self, layer: int, gate: object, up: object) -> None:
        """As :meth:`capture`."""

    def should_abort(self) -> bool:
        return self.abortable and self.abort.is_set()


class SimBackward:
    """The grant around host steps over the simulated device (what
    :class:`~deltaserve.train.backward.driver.BackwardDriver` is to the real trainer)."""

    def __init__(self, policy: GrantPolicy, device: GpuTimeline, model: BackwardCost,
                 noise: StepNoise, tp: int):
        self.policy, self.device, self.model, self.noise, self.tp = policy, device, model, noise, tp
        self.job_samples: tuple[JobSample, ...] = ()
        self.layer_s = 0.0

    @property
    def busy(self) -> bool:
        return self.device.job is not None

    @property
    def exclusive(self) -> bool:
        return self.policy is GrantPolicy.EXCLUSIVE

    def before_step(self, shape: StepShape) -> None:
        """As the real driver: an exclusive backward yields every step (the device makes the
        step wait for its layer boundary); under ``prefill``, steps with prefill or training
        rows take the GPU back."""
        if self.exclusive or (self.policy is GrantPolicy.PREFILL
                              and (shape.prefill_lens or shape.ft_lens)):
            self.device.set_grant(False)

    def after_step(self) -> None:
        if not self.exclusive:
            self.device.set_grant(True)

    def release(self) -> None:
        self.device.set_grant(True)

    def lend(self, seconds: float, wake: threading.Event) -> float:
        """The host lends the device now: the backward runs until the host's next step, which
        the simulated host schedules ``seconds`` later (or at an arrival). Simulated time does
        not pass inside this call, so the time given is the time promised."""
        self.device.set_grant(True)
        return seconds

    def submit(self, samples: tuple[JobSample, ...]) -> None:
        t = self.model.time(BackwardJob(tuple(s.length for s in samples), self.tp))
        f = self.noise.factor()
        self.layer_s = t.layer_unit_s * f
        n = self.model.num_layers
        self.job_samples = samples
        self.device.start_job(JobTiming(t.layers_s * f / n, n, t.head_s * f, t.optimizer_s))


class SimTrainer(GrantDelegation):
    """``replica``: the data-parallel rank whose samples this trainer commits."""

    def __init__(self, config: CoServeConfig, book: SampleBook, backward: SimBackward,
                 clock: SimClock):
        self.config, self.book, self.clock = config, book, clock
        self.backward = backward
        self.counts: Counter[str] = Counter()
        self.optimizer_steps = 0
        self.last_loss: float | None = None
        self.backward_busy_s = 0.0  # simulated seconds the backward computed (not parked)
        self.ledger = None  # the simulated host forms no data-parallel group
        self._listeners: list[Listener] = []
        self._loss: dict[int, int] = {}  # loss tokens by sample id, counted once

    @property
    def has_pending(self) -> bool:
        return self.book.has_ready or self.backward.busy

    @property
    def steps_lost(self) -> dict[str, int]:
        """A simulated backward loses no step."""
        return {}

    def step(self, plan: AdmissionPlan, rows: TrainingRows, abortable: bool,
             abort: threading.Event) -> SimStep:
        return SimStep(plan, rows, abortable, abort)

    def poll(self, timeout_s: float = 0.0) -> None:
        """Commit a job the device has completed by now (simulated time never waits here: an
        idle simulated host sleeps until the completion instead)."""
        job = self.backward.device.take_completed()
        if job is not None:
            self._commit(self.backward.job_samples, job.started_s, job.parked_s)
        self.maybe_launch()

    def maybe_launch(self, force: bool = False) -> None:
        if self.backward.busy or not self.book.has_ready:
            return
        batch = self.config.backward.batch_tokens
        if force or self.book.ready_tokens >= batch or not self.book.can_admit():
            self.backward.submit(self.book.take_batch(batch))

    def _commit(self, samples: tuple[JobSample, ...], started_s: float, parked_s: float
                ) -> None:
        ids = tuple(s.sample_id for s in samples)
        epoch = self.book.commit(ids)
        step = self.optimizer_steps
        self.optimizer_steps += 1
        loss_tokens = sum(self._loss_tokens(i) for i in ids)
        now = self.clock.now()
        self.backward_busy_s += now - started_s - parked_s
        self._emit(OptimizerStep(now, step, epoch, ids, sum(s.length for s in samples),
                                 loss_tokens, NAN, NAN, NAN, self.config.optimizer.lr,
                                 now - started_s, parked_s))

    def _loss_tokens(self, sample_id: int) -> int:
        n = self._loss.get(sample_id)
        if n is None:
            n = self._loss[sample_id] = self.book.samples[sample_id].num_loss_tokens
        return n

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def _emit(self, event: TrainingEvent) -> None:
        for listener in self._listeners:
            listener(event)

    def drain(self, timeout_s: float) -> None:
        """Train what was captured: run the simulation until it is committed (``timeout_s``
        of simulated time at most)."""
        deadline = self.clock.now() + timeout_s
        device = self.backward.device
        while self.has_pending:
            self.maybe_launch(force=True)
            if device.job is not None and not device.job_completed and not self.clock.run(
                    until=lambda: device.job_completed, max_s=deadline):
                raise TimeoutError(f"drain: backward not done after {timeout_s} simulated s")
            self.poll()

    def close(self, *, drain: bool, checkpoint: bool, timeout_s: float) -> None:
        """Return what was not committed to the pool (nothing is checkpointed: a simulation
        trains no weights)."""
        if drain:
            self.drain(timeout_s)
        if self.backward.busy:
            self.book.release(s.sample_id for s in self.backward.job_samples)
            self.backward.device.job = None
        self.book.release_ready()


@dataclass(frozen=True)
class SimTrainerFactory:
    """Builds a :class:`SimTrainer` on ``device``; ``policy`` resolves ``auto`` (``prefill`` on
    a simulated GPU, ``partition`` when validating against a CPU run)."""

    clock: SimClock
    device: GpuTimeline
    model: BackwardCost
    noise: StepNoise
    tp: int = 1

    def __call__(self, config: CoServeConfig, book: SampleBook) -> SimTrainer:
        policy = config.backward.grant_policy
        if policy is GrantPolicy.AUTO:
            policy = self.device.policy
        require(policy is self.device.policy, "grant_policy", policy.value,
                f"this simulated device runs the {self.device.policy.value} policy")
        config = replace(config, backward=replace(config.backward, grant_policy=policy,
                                                  threads=1))
        backward = SimBackward(policy, self.device, self.model, self.noise, self.tp)
        return SimTrainer(config, book, backward, self.clock)
