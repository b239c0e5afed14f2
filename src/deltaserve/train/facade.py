"""The co-server's policy, over any training half: :class:`deltaserve.core.contract.CoServingHooks`
over its parts.

* :class:`~deltaserve.train.samples.SampleBook`: pool, buffer rows, dropout seeds, ready queue;
* :class:`~deltaserve.core.admission.AdmissionScheduler`: Algorithm 1 (or a baseline policy)
  over the latency model;
* a :class:`~deltaserve.train.trainer_protocol.CoTrainer`: what trains the captured samples,
  built by the factory the co-server is given (the real :class:`~deltaserve.train.trainer.Trainer`
  through :class:`~deltaserve.train.trainer.TorchTrainerFactory`, see :meth:`CoServer.for_model`,
  or a simulated host's timed stand-in).

Sample lifecycle: admitted (claimed, rows reserved) → captured (ready) → in the backward →
committed (adapter published, rows freed). An aborted step or a lost backward job releases its
samples, so each is trained exactly once per epoch. Once the training half gives up
(:class:`~deltaserve.train.events.TrainingStopped`: every step lost), steps admit nothing more
and the co-server serves inference alone; :meth:`CoServer.raise_if_failed` says why.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace

from deltaserve.core.admission import (
    AdmissionMode,
    AdmissionPlan,
    AdmissionScheduler,
    SchedulingView,
    Skip,
)
from deltaserve.core.arrival_rate import PromptArrivals
from deltaserve.core.calibration import HostLimits
from deltaserve.core.contract import StepReport, TrainingStep
from deltaserve.core.data import TrainingSample
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.pool import SamplePool
from deltaserve.core.shape import StepShape
from deltaserve.core.slo import Lookahead
from deltaserve.core.yield_reserve import YieldReserve
from deltaserve.model.llama import LlamaModel
from deltaserve.model.lora import AdapterWeights
from deltaserve.train.config import CoServeConfig
from deltaserve.train.events import CoServeStats, Listener, TrainingEvent, TrainingStopped
from deltaserve.train.lost_steps import TrainingFailed
from deltaserve.train.samples import SampleBook, buffer_capacity
from deltaserve.train.trainer import Publish, TorchTrainerFactory, Trainer
from deltaserve.train.trainer_protocol import CoTrainer, TrainerFactory


class CoServer:
    """``trainer``: builds the training half over the facade's sample book. ``pool``: a sample
    pool shared with other co-servers (data-parallel replicas claim from one pool, so every
    sample is trained once across them); by default the facade's own."""

    def __init__(self, config: CoServeConfig, limits: HostLimits,
                 samples: Sequence[TrainingSample], trainer: TrainerFactory, *,
                 latency_model: LatencyModel | None = None,
                 scheduler_cls: type[AdmissionScheduler] = AdmissionScheduler,
                 pool: SamplePool | None = None, clock: Callable[[], float] = time.monotonic):
        b = config.backward
        self.book = SampleBook(samples, num_epochs=config.num_epochs, seed=config.seed,
                               buffer_tokens=buffer_capacity(b.buffer_tokens, b.batch_tokens,
                                                             limits, samples), pool=pool,
                               shard=config.data_shard)
        self.trainer: CoTrainer = trainer(config, self.book)
        self.config = self.trainer.config  # the grant policy resolved for the device
        self.latency = latency_model or LatencyModel(config.latency)
        self.scheduler = scheduler_cls(self.config.admission, self.config.slo, limits,
                                       self.latency, self.book.pool, self.book.ledger)
        self._abort = threading.Event()
        self._reserve = YieldReserve(self.config.backward.yield_reserve)
        # prompts arriving within one TPOT objective: what a decode gap can wait through
        self._arrivals = PromptArrivals(self.config.slo.tpot_s)
        self._clock = clock
        self._planned_at_s = 0.0  # when the step in flight started: planned, or due after a yield
        self._due_s = math.inf  # when the yield before the next step was due to end
        self._lent_reserve_s = 0.0  # the reserve the yield before the next step kept
        self._lent_s = 0.0  # seconds lent to the backward since the last planned step
        self.step_yield_s = 0.0  # seconds lent just before the step last planned (its record)
        # seconds the co-server's own hooks held the host's thread between the step before the
        # one last planned and it (that step's observe, this one's plan, the park wait
        # included): the step's record, so time between steps is split into ours and the host's
        self.step_hooks_s = 0.0
        self._observe_s = 0.0
        # production counters (the service's /metrics reads them through stats())
        self._skips: Counter[str] = Counter()
        self._timing: Counter[str] = Counter()
        self._failure: TrainingFailed | None = None
        self.trainer.subscribe(self._on_training_event)

    @classmethod
    def for_model(cls, config: CoServeConfig, limits: HostLimits, model: LlamaModel,
                  samples: Sequence[TrainingSample], *, base_model: str,
                  latency_model: LatencyModel | None = None, publish: Publish | None = None,
                  scheduler_cls: type[AdmissionScheduler] = AdmissionScheduler,
                  validation: Sequence[TrainingSample] = ()) -> CoServer:
        """The co-server of a real host: the torch :class:`Trainer` over ``model``'s weights
        (adapter, optimizer state, activation buffer, the backward process, checkpoints)."""
        return cls(config, limits, samples,
                   TorchTrainerFactory(model, base_model, publish, tuple(validation)),
                   latency_model=latency_model, scheduler_cls=scheduler_cls)

    @property
    def _real(self) -> Trainer:
        if not isinstance(self.trainer, Trainer):
            raise TypeError(f"{type(self.trainer).__name__} trains no adapter: only a real "
                            "host's co-server (CoServer.for_model) has one")
        return self.trainer

    @property
    def adapter(self) -> AdapterWeights:
        """The trained adapter (shared with the backward; published after every step)."""
        return self._real.adapter

    @property
    def model(self) -> LlamaModel:
        """The model whose weights the backward shares."""
        return self._real.model

    @property
    def backward_busy(self) -> bool:
        return self.trainer.backward_busy

    # ---- the host contract (CoServingHooks) -------------------------------------------------
    def plan(self, view: SchedulingView) -> TrainingStep:
        t0 = time.perf_counter()
        step = self._plan(view)
        self.step_hooks_s, self._observe_s = self._observe_s + time.perf_counter() - t0, 0.0
        return step

    def _plan(self, view: SchedulingView) -> TrainingStep:
        self._next_step(view)
        # a step's time runs from its planning, or from when the yield before it was due to
        # end if the host got the machine back later (the yield overran, the poll after it)
        self._planned_at_s, self._due_s = min(self._clock(), self._due_s), math.inf
        t = self.trainer
        t.poll()
        room = self.config.backward.batch_tokens - self.book.ready_tokens
        # after a yield, admission (when it may run beside the backward) keeps its reserve too
        reserve_s, self._lent_reserve_s = self._lent_reserve_s, 0.0
        self.step_yield_s, self._lent_s = self._lent_s, 0.0
        if self.step_yield_s > 0:  # priced, and learned from, at the after-yield level
            view = _after_yield(view)
        if self._failure is not None:  # training gave up: the step serves inference only
            plan = AdmissionPlan((), view.proposed, None, math.nan, Skip.OFF)
        else:
            plan = self.scheduler.plan(view, backward_running=t.backward_busy,
                                       batch_room_tokens=room, reserve_s=reserve_s,
                                       ahead=self._ahead(view))
        if plan.skip is not None:
            self._skips[plan.skip.value] += 1
        if plan.sample_ids:
            self._timing["ft_tokens_admitted"] += plan.num_ft_tokens
        rows = self.book.rows(plan, self.config.lora.dropout)
        t.before_step(plan.shape)
        abortable = self.config.interrupt and bool(plan.sample_ids) \
            and not plan.shape.has_inference
        return t.step(plan, rows, abortable, self._abort)

    def observe(self, report: StepReport) -> None:
        t0 = time.perf_counter()
        self._observe(report)
        self._observe_s += time.perf_counter() - t0

    def _observe(self, report: StepReport) -> None:
        t = self.trainer
        self._arrivals.ran(sum(report.shape.prefill_lens))
        t.after_step()
        plan = report.step.plan
        shape = replace(report.shape, after_yield=plan.shape.after_yield)
        upper_s = self._upper_s(report, shape)
        if report.aborted:
            self.book.release(plan.sample_ids)
            t.counts["aborted_steps"] += 1
        else:
            if not shape.is_empty:
                predicted = self.latency.observe(shape, report.seconds)
                self.scheduler.observe(shape, report.seconds)
                if predicted is not None:
                    self._timing["steps_timed"] += 1
                    self._timing["predicted_s"] += predicted
                    self._timing["measured_s"] += report.seconds
            if plan.sample_ids:
                self.book.captured(plan)
                t.counts["steps_with_ft"] += 1
                t.counts["ft_tokens_forwarded"] += plan.num_ft_tokens
        self._abort.clear()
        t.maybe_launch()
        if upper_s is not None:
            self._reserve.step_ended(self._planned_at_s + upper_s, self._clock())

    def _next_step(self, view: SchedulingView) -> None:
        """The host's next step starts from ``view`` (now, before any yield): the step before
        counts as late as now where decodes are in flight (the engine starts at once, so the
        time since the step's end was the host's, between its steps)."""
        decoding = view.oldest_decode_token_s is not None
        self._reserve.next_step(self._clock() if decoding else None)
        self._arrivals.seen(view.now_s, view.queued_prompt_tokens)

    def on_arrival(self) -> None:
        self._abort.set()

    def wants_step(self) -> bool:
        if self.trainer.has_pending:
            return True
        return (self._failure is None and self.config.admission.mode is not AdmissionMode.OFF
                and self.latency.is_calibrated and self.book.can_admit())

    def idle(self, timeout_s: float) -> None:
        self._reserve.next_step(None)
        self.trainer.release_backward()
        self.trainer.poll(timeout_s)

    def yield_budget_s(self, view: SchedulingView) -> float:
        self._next_step(view)
        b, t = self.config.backward, self.trainer
        if not (t.backward_exclusive and b.yield_to_backward and t.backward_busy):
            return 0.0
        # the backward stops at a layer boundary: the reserve is at least two layers
        slack_s = self.scheduler.yield_budget_s(_after_yield(view), ahead=self._ahead(view))
        return self._reserve.budget_s(slack_s, 2 * t.backward_layer_s, b.max_yield_s)

    def _ahead(self, view: SchedulingView) -> Lookahead:
        """What the steps ahead of ``view`` keep back. Their lateness: how late recent
        inference steps ended past their predictions (the yield reserve's lateness, without
        the layer-boundary floor that only the step after a yield pays), kept back for each
        step a waiting request still waits through before its first token; 0 where the host
        does not yield, or before the reserve has seen enough steps. (A TTFT spans several
        steps: a burst's queue waited through up to five, each after a yield, and their
        lateness added up past the TTFT objective; see docs/log.md.) And how fast prompts
        have been arriving, which a phase-separated host's waiting decodes wait through."""
        late_s = self._reserve.reserve_s(0.0)
        return Lookahead(late_s if math.isfinite(late_s) else 0.0,
                         self._arrivals.tokens_per_s(view.now_s))

    def _upper_s(self, report: StepReport, shape: StepShape) -> float | None:
        """The margin-inflated prediction of an inference step that ran whole, before the
        latency model learns from it. Its lateness, what the yield reserve learns from, is the
        time from its start (see :meth:`plan`) to the end of :meth:`observe` (the wait for the
        backward to stop, the forward, this bookkeeping), or to the host's next step where
        decodes are in flight (:meth:`_next_step`), less this. ``None`` where the host
        never yields (the reserve is not needed, and steps pay for no extra prediction)."""
        b, t = self.config.backward, self.trainer
        if not (t.backward_exclusive and b.yield_to_backward):
            return None
        if report.aborted or not shape.has_inference or not self.latency.is_calibrated:
            return None
        return self.latency.predict_upper(shape)

    def yield_to_backward(self, seconds: float, wake: threading.Event) -> float:
        self._due_s = self._clock() + seconds
        given = self.trainer.lend(seconds, wake)
        self._lent_s += given
        self._lent_reserve_s = self._reserve.reserve_s(2 * self.trainer.backward_layer_s)
        self.trainer.counts["yields"] += 1
        self.trainer.poll()
        return given

    # ---- lifecycle --------------------------------------------------------------------------
    def poll(self, timeout_s: float = 0.0) -> None:
        """Handle backward results now (waiting up to ``timeout_s`` for one)."""
        self.trainer.poll(timeout_s)

    def _on_training_event(self, event: TrainingEvent) -> None:
        if isinstance(event, TrainingStopped) and self._failure is None:
            # the trainer's own failure (set before it emits the event) keeps its cause
            self._failure = self.trainer.failure or TrainingFailed(event.reason,
                                                                   event.lost_steps)

    @property
    def failure(self) -> TrainingFailed | None:
        """Why training stopped for good (``None`` while it trains)."""
        return self._failure

    def raise_if_failed(self) -> None:
        """Raise :class:`TrainingFailed` if training gave up: a caller that reports training
        throughput must not report a run that trained nothing as a result."""
        if self._failure is not None:
            raise self._failure

    def subscribe(self, listener: Listener) -> None:
        """``listener`` receives every training event from now on, on the host's thread."""
        self.trainer.subscribe(listener)

    def drain(self, timeout_s: float = 600.0) -> None:
        self.trainer.drain(timeout_s)

    def close(self, *, drain: bool = True, checkpoint: bool = True,
              timeout_s: float = 600.0) -> None:
        self.trainer.close(drain=drain, checkpoint=checkpoint, timeout_s=timeout_s)

    def stats(self) -> CoServeStats:
        """Data parallel: the tokens and samples committed, and the epoch, are the group's
        (what the one adapter holds); every other counter is this replica's."""
        c, t = self.trainer.counts, self.trainer
        p = t.ledger.progress() if t.ledger is not None else self.book.progress()
        # dict() of a Counter is one C-level copy: safe against the stepping thread's updates
        timing = dict(self._timing)
        return CoServeStats(p.tokens_committed_total, p.samples_committed_total,
                            c["ft_tokens_forwarded"], t.optimizer_steps, c["steps_with_ft"],
                            c["aborted_steps"], c["backward_failures"], c["worker_restarts"],
                            c["io_errors"], p.epoch, t.last_loss, dict(self._skips),
                            timing.get("ft_tokens_admitted", 0), timing.get("steps_timed", 0),
                            timing.get("predicted_s", 0.0), timing.get("measured_s", 0.0),
                            t.backward_busy_s, dict(t.steps_lost))


def _after_yield(view: SchedulingView) -> SchedulingView:
    """``view`` with its proposed step marked as following a yield to the backward."""
    return replace(view, proposed=replace(view.proposed, after_yield=True))
