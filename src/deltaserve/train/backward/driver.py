"""The backward driver: the backward process, when it may compute (the grant policy), and its
results as one kind of outcome.

A job ends in exactly one :data:`BackwardOutcome`: ``BackwardDone`` (the adapter holds its step),
``EvalDone`` (a validation loss) or :class:`JobLost` (the job raised, or the process died and was
restarted, unless it was a data-parallel replica's; the adapter is at the last committed step).
The co-server handles each in one place, whichever call observed it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

from deltaserve.core.shape import StepShape
from deltaserve.train.backward.messages import (
    BackwardDone,
    BackwardFailed,
    BackwardJob,
    EvalDone,
    EvalJob,
    LayerDone,
)
from deltaserve.train.backward.process import BackwardEvent, BackwardProcess, WorkerLost
from deltaserve.train.backward.worker import SharedState, WorkerSpec
from deltaserve.train.config import BackwardConfig, GrantPolicy

# Until the first layer is timed: a conservative guess at the backward's time per layer.
_INITIAL_LAYER_S = 0.05
_LAYER_EMA = 0.3  # weight of the newest layer time in the running estimate
_LEND_POLL_S = 0.002  # how often a yield checks whether the backward still has work that fits


@dataclass(frozen=True)
class JobLost:
    """``job`` did not reach the adapter. ``reason``: the traceback, or how the process died.
    ``rolled_back``: the process died while publishing and the shared state was restored to the
    last committed step. ``group_lost``: data parallel, the job's all-reduce failed (a peer is
    gone)."""

    job: BackwardJob | EvalJob
    reason: str
    process_died: bool
    rolled_back: bool = False
    group_lost: bool = False


BackwardOutcome = BackwardDone | EvalDone | JobLost


def resolve_policy(config: BackwardConfig, on_gpu: bool, cpu_threads: int) -> BackwardConfig:
    """``auto`` resolved for the device, and the backward's threads (every core when it runs
    only while the host waits, else one)."""
    policy = config.grant_policy
    if policy is GrantPolicy.AUTO:
        policy = GrantPolicy.PREFILL if on_gpu else GrantPolicy.EXCLUSIVE
    threads = config.threads
    if threads is None:
        threads = cpu_threads if policy is GrantPolicy.EXCLUSIVE else 1
    return replace(config, grant_policy=policy, threads=threads)


class BackwardDriver:
    def __init__(self, config: BackwardConfig, spec: WorkerSpec, shared: SharedState):
        assert config.grant_policy is not GrantPolicy.AUTO and config.threads is not None
        self.config = config
        self.process = BackwardProcess(spec, shared)
        self._layer_ema_s = _INITIAL_LAYER_S
        self._job: BackwardJob | EvalJob | None = None
        self.process.wait_ready()

    @property
    def busy(self) -> bool:
        return self.process.busy

    @property
    def layer_s(self) -> float:
        """The backward's grain: its recent time per unit of work, or more while it waits to
        start a longer unit (a yield the unit cannot end in gives it nothing to do)."""
        return max(self._layer_ema_s, self.process.grant.waiting_s)

    @property
    def exclusive(self) -> bool:
        """The backward computes only while the host waits (idle time and yields)."""
        return self.config.grant_policy is GrantPolicy.EXCLUSIVE

    # ---- the grant around host steps --------------------------------------------------------
    def before_step(self, shape: StepShape) -> None:
        """Take the machine back for a step that needs it."""
        grant = self.process.grant
        if self.exclusive:
            # the step gets every core: wait out the backward's current layer, however long
            # (the one through the LM head and the loss takes longer than a decoder layer; a
            # step that ran beside the backward would run late by the cores it lost). The
            # wait is part of the step's lateness, which the yield reserve keeps back.
            grant.clear()
            self.process.wait_parked(self.config.park_timeout_s)
        elif self.config.grant_policy is GrantPolicy.PREFILL and (shape.prefill_lens
                                                                   or shape.ft_lens):
            grant.clear()

    def after_step(self) -> None:
        if not self.exclusive:
            self.process.grant.set()  # decode steps and idle time may overlap the backward

    def release(self) -> None:
        """The host runs nothing: the backward may use the whole machine."""
        self.process.grant.set()

    def lend(self, seconds: float, wake: threading.Event) -> float:
        """Let the backward run for ``seconds``, until ``wake``, or until it has nothing to do
        in the rest: parked with no unit to start (its job ended, or a data-parallel replica
        waits for its peers), or waiting for a unit that would not end by then. The host takes
        the rest back; the time given."""
        t0 = time.monotonic()
        until_s = t0 + seconds
        grant = self.process.grant
        grant.set(until_s=until_s)  # no unit that would run past the yield
        while not wake.wait(min(_LEND_POLL_S, max(0.0, until_s - time.monotonic()))):
            now = time.monotonic()
            # the worker sets waiting_s before it parks and clears it after it resumes: parked
            # with none means it is not waiting to start a unit
            waiting_s = grant.waiting_s
            if now >= until_s or (self.process.parked.value
                                  and (waiting_s == 0 or now + waiting_s > until_s)):
                break
        return time.monotonic() - t0

    # ---- jobs -------------------------------------------------------------------------------
    def submit(self, job: BackwardJob | EvalJob) -> None:
        self._job = job
        self.process.submit(job)

    def outcomes(self, timeout_s: float = 0.0) -> list[BackwardOutcome]:
        """Results of the in-flight job (waiting up to ``timeout_s`` for any message)."""
        return self._translate(self.process.poll(timeout_s))

    def wait(self, timeout_s: float) -> list[BackwardOutcome]:
        """Until the in-flight job ends or ``timeout_s`` passes."""
        self.process.grant.set()
        return self._translate(self.process.wait(timeout_s))

    def _translate(self, events: list[BackwardEvent]) -> list[BackwardOutcome]:
        out: list[BackwardOutcome] = []
        for ev in events:
            if isinstance(ev, LayerDone):
                self._layer_ema_s += _LAYER_EMA * (ev.compute_s - self._layer_ema_s)
            elif isinstance(ev, BackwardDone | EvalDone):
                out.append(ev)
            elif isinstance(ev, BackwardFailed):
                assert self._job is not None and self._job.step == ev.step
                out.append(JobLost(self._job, ev.error, process_died=False,
                                   group_lost=ev.group_lost))
            elif isinstance(ev, WorkerLost):
                out.append(JobLost(ev.job, f"backward process died (exit code {ev.exitcode})",
                                   process_died=True, rolled_back=ev.rolled_back))
        return out

    def stop(self, timeout_s: float) -> list[BackwardOutcome]:
        """Stop the process; the outcome of a job it had in flight is among the results."""
        return self._translate(self.process.stop(timeout_s=timeout_s))
