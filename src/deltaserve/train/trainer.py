"""The training half of a co-server: captured samples to committed optimizer steps.

It owns the trainable adapter and its optimizer state (both shared with the backward process),
the activation buffer, the backward driver and the checkpointer, and turns every outcome of the
backward, whichever call observes it, into one path (:meth:`Trainer._handle`): a committed step
is published to the host, logged and announced to listeners; a lost one returns its samples to
the pool. With validation samples, the adapter's held-out loss is computed in the backward
process after every ``validation_interval`` steps and after the last, before the next step is
submitted (a :class:`ValidationLoss` follows each :class:`OptimizerStep` that says
``validating``).

Data parallel (``config.data_parallel`` of more than one replica): every step is a global step
of the replicas' group, and which steps this replica submits follows
:mod:`deltaserve.train.group_steps` (an empty share when it has nothing to train and a peer
steps; the next epoch's samples held back until every replica's share of the epoch is
trained; at close, empty shares until every replica has closed).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from deltaserve.core.admission import AdmissionPlan
from deltaserve.core.contract import TrainingRows
from deltaserve.core.data import TrainingSample
from deltaserve.model.llama import LlamaModel
from deltaserve.model.lora import AdapterWeights
from deltaserve.train.backward.driver import (
    BackwardDriver,
    BackwardOutcome,
    JobLost,
    resolve_policy,
)
from deltaserve.train.backward.messages import (
    BackwardDone,
    BackwardJob,
    EvalDone,
    EvalJob,
    JobSample,
)
from deltaserve.train.backward.worker import SharedState, WorkerSpec
from deltaserve.train.buffer import ActivationBuffer, BufferConfig
from deltaserve.train.checkpoint_policy import Checkpointer
from deltaserve.train.config import CoServeConfig
from deltaserve.train.events import (
    Listener,
    OptimizerStep,
    StepLost,
    TrainingEvent,
    TrainingIOError,
    TrainingStopped,
    ValidationLoss,
)
from deltaserve.train.group_ledger import GroupLedger
from deltaserve.train.group_steps import GroupSteps, Share, Votes
from deltaserve.train.lost_steps import LostSteps, TrainingFailed, reason_summary
from deltaserve.train.optim import OptimizerState
from deltaserve.train.publish import PublishGuard
from deltaserve.train.samples import SampleBook
from deltaserve.train.step import CapturingStep
from deltaserve.train.trainer_protocol import GrantDelegation

Publish = Callable[[AdapterWeights], None]
logger = logging.getLogger("deltaserve")


class Trainer(GrantDelegation):
    def __init__(self, config: CoServeConfig, model: LlamaModel, book: SampleBook, *,
                 base_model: str, publish: Publish | None = None,
                 validation: Sequence[TrainingSample] = ()):
        device = model.weights.device
        self.config, self.book, self._publish = config, book, publish
        self.model = model  # its weights are shared with the backward process
        self.adapter = AdapterWeights(model.config, config.lora, device=device)
        self.adapter.init_peft_(config.seed)
        self.optimizer_state = OptimizerState(self.adapter.numel)
        b = config.backward
        self.buffer = ActivationBuffer(BufferConfig(book.ledger.capacity_tokens, b.buffer_save,
                                                    b.buffer_offload),
                                       model.config, model.weights.dtype, device)
        dp = config.data_parallel
        self.checkpointer = Checkpointer(config.checkpoint, base_model, book.fingerprint,
                                         dp.rank)
        self.group = GroupSteps(dp.world_size) if dp.distributed else None
        self.ledger = GroupLedger(book.pool) if dp.distributed else None
        self.optimizer_steps, self.resumed_from = 0, None
        self._restore(model)
        if device.type == "cpu":
            model.weights.share_memory_()
            self.adapter.share_memory_()
        self.optimizer_state.share_memory_()
        guard = PublishGuard(self.adapter.flat, self.adapter.numel).share_memory_()
        self._closing = False  # close() began: this replica submits no new real work
        self._votes: dict[int, Votes] = {}  # the in-flight step's votes, by step
        self.backward = BackwardDriver(b, WorkerSpec(config.lora, config.optimizer, b.threads,
                                                     dp),
                                       SharedState(model.config, model.weights, self.adapter.flat,
                                                   self.optimizer_state, self.buffer, guard))
        self.counts: Counter[str] = Counter()
        self.backward_busy_s = 0.0
        self.last_loss: float | None = None
        self.lost = LostSteps(b.stop_after_lost_steps)
        self.failure: TrainingFailed | None = None  # set once training gave up
        self._listeners: list[Listener] = []
        self._validation = (tuple(s.input_ids for s in validation),
                            tuple(s.labels for s in validation))
        self._validation_due: int | None = None  # the step whose validation loss is owed

    @property
    def has_pending(self) -> bool:
        """Samples captured or in the backward but not yet committed, or a validation owed
        (none once training gave up: nothing more will be trained)."""
        if self.failure is not None:
            return self.backward.busy
        if self.backward.busy or self._validation_due is not None:
            return True
        if self.group is None:
            return self.book.has_ready
        # a finished group trains nothing more: what is still ready goes back at close
        return self.group.share(self.book.has_ready, self._leaving) is not Share.NONE

    @property
    def _leaving(self) -> bool:
        """Data parallel: this replica will submit no more real steps (closing, or finished)."""
        return self._closing or self.book.progress().finished

    @property
    def steps_lost(self) -> dict[str, int]:
        """Optimizer steps lost, by kind (a production counter)."""
        return dict(self.lost.by_kind)

    def step(self, plan: AdmissionPlan, rows: TrainingRows, abortable: bool,
             abort: threading.Event) -> CapturingStep:
        """The step whose captures write the admitted rows of the activation buffer."""
        return CapturingStep(plan, rows, abortable, self.buffer, abort)

    # ---- outcomes of the backward -----------------------------------------------------------
    def poll(self, timeout_s: float = 0.0) -> None:
        for outcome in self.backward.outcomes(timeout_s):
            self._handle(outcome)
        if self.checkpointer.retry_due():
            self._retry_writes()
        self.maybe_launch()

    def maybe_launch(self, force: bool = False) -> None:
        """Submit the ready samples as one optimizer step once they fill a backward batch (or
        nothing more can be admitted, or ``force``), unless a failed write holds training."""
        if self.backward.busy or self.failure is not None:
            return
        if self._validation_due is not None:  # before the next step changes the adapter
            self.backward.submit(EvalJob(self._validation_due, *self._validation))
            return
        if self.checkpointer.blocked:
            return
        if self.group is None:
            if not self.book.has_ready:
                return
        else:
            share = self.group.share(self.book.has_ready, self._leaving)
            if share is Share.EMPTY:
                self._submit(())  # this replica's empty share of a step its peers take
            if share is not Share.REAL:
                return
        batch = self.config.backward.batch_tokens
        if force or self.book.ready_tokens >= batch or not self.book.can_admit():
            self._submit(self.book.take_batch(batch))

    def _submit(self, samples: tuple[JobSample, ...]) -> None:
        job = BackwardJob(self.optimizer_steps, samples)
        if self.group is not None:
            votes = self.group.votes(self.book.progress(), len(samples), self._closing)
            self._votes = {job.step: votes}
            job = replace(job, epoch_open=votes.epoch_open, staying=votes.staying)
        self.backward.submit(job)

    def _handle(self, outcome: BackwardOutcome) -> None:
        if isinstance(outcome, BackwardDone):
            self.backward_busy_s += outcome.wall_s - outcome.paused_s
            self._commit(outcome)
            return
        if isinstance(outcome, EvalDone):
            self.backward_busy_s += outcome.wall_s - outcome.paused_s
            self._validated(ValidationLoss(time.monotonic(), outcome.step, outcome.loss,
                                           outcome.num_loss_tokens,
                                           outcome.mean_token_accuracy))
            return
        if isinstance(outcome.job, EvalJob):
            self.counts["validation_failures"] += 1
            self._validated(ValidationLoss(time.monotonic(), outcome.job.step, None, 0, None,
                                           outcome.reason))
            return
        self.book.release(s.sample_id for s in outcome.job.samples)
        restarted = outcome.process_died and self.group is None
        self.counts["worker_restarts" if restarted else "backward_failures"] += 1
        rolled = "; the half-published step was rolled back" if outcome.rolled_back else ""
        self._emit(StepLost(time.monotonic(), outcome.job.step, len(outcome.job.samples),
                            outcome.reason + rolled))
        failure = self.lost.lost(outcome.job.step, outcome.reason, outcome.process_died)
        if self.group is not None and (outcome.process_died or outcome.group_lost):
            failure = self._group_failure(outcome)
        if failure is not None and self.failure is None:
            self._give_up(failure)

    def _group_failure(self, outcome: JobLost) -> TrainingFailed:
        """A data-parallel replica whose backward died, or whose group lost a peer, can never
        step again (no new member joins the group, and a failed collective leaves the ranks
        out of step): it stops training at once, retrying nothing. Its samples are back in its
        pool; serving goes on."""
        dp = self.config.data_parallel
        what = ("its backward process died" if outcome.process_died
                else f"the group lost a peer ({reason_summary(outcome.reason)})")
        return TrainingFailed(f"data-parallel replica {dp.rank} of {dp.world_size}: {what}; "
                              f"the group cannot step again, so this replica trains no more",
                              self.lost.consecutive, cause="the data-parallel group lost a member")

    def _give_up(self, failure: TrainingFailed) -> None:
        """Stop training for good: no more jobs (the captured samples go back to the pool);
        the facade admits no more samples once it hears :class:`TrainingStopped`."""
        self.failure = failure
        self.book.release_ready()
        self._validation_due = None
        logger.error("%s", failure)
        self._emit(TrainingStopped(time.monotonic(), failure.reason, failure.lost_steps,
                                   failure.cause))

    def _commit(self, ev: BackwardDone) -> None:
        votes = self._votes.pop(ev.step, None)
        if self.group is not None and votes is not None:
            self.group.observe(votes, ev.group_epoch_open, ev.group_staying)
        if self.ledger is not None:
            self.ledger.record(ev.group_sample_ids)
        self.lost.committed()
        if not ev.stepped:  # every replica's share was empty: no optimizer step anywhere
            return
        # an empty share commits nothing (a finished pool must not see a commit at all)
        epoch = self.book.commit(ev.sample_ids) if ev.sample_ids else self.book.pool.epoch
        self.optimizer_steps = ev.step + 1
        if ev.num_loss_tokens:
            self.last_loss = ev.loss
        if self._publish is not None:
            self._publish(self.adapter)
        finished = self.book.progress().finished
        validating = bool(self._validation[0]) and (
            self.optimizer_steps % self.config.validation_interval == 0 or finished)
        if validating:
            self._validation_due = ev.step
        self._emit(OptimizerStep(time.monotonic(), ev.step, epoch, ev.sample_ids, ev.num_tokens,
                                 ev.num_loss_tokens, ev.loss, ev.mean_token_accuracy,
                                 ev.grad_norm, ev.lr, ev.wall_s, ev.paused_s, validating,
                                 ev.allreduce_s, ev.group_sample_ids))
        if self.checkpointer.due(self.optimizer_steps, finished):
            self.save_checkpoint()

    def _validated(self, event: ValidationLoss) -> None:
        self._validation_due = None
        self._emit(event)

    # ---- checkpoints and events -------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """Checkpoint the last committed step (a failure is reported, never raised)."""
        # data parallel: the group's progress (rank 0 writes it once for every replica)
        pool = self.ledger.state_dict() if self.ledger is not None else self.book.pool.state_dict()
        ev = self.checkpointer.save(self.optimizer_steps, self.adapter, self.optimizer_state,
                                    pool)
        if ev is not None:
            self._emit(ev)

    def _retry_writes(self) -> None:
        ev = self.checkpointer.flush()
        if ev is not None:
            self._notify(ev)
        elif self.checkpointer.blocked:
            self.save_checkpoint()

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def _emit(self, event: TrainingEvent) -> None:
        failed = None if isinstance(event, TrainingIOError) else self.checkpointer.log(event)
        self._notify(event)
        if failed is not None:
            self._notify(failed)

    def _notify(self, event: TrainingEvent) -> None:
        if isinstance(event, TrainingIOError):
            self.counts["io_errors"] += 1
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a listener's bug must not reach the host's step
                logger.exception("a training-event listener failed on %s", type(event).__name__)

    def _restore(self, model: LlamaModel) -> None:
        ck = self.checkpointer.restore(model.config, self.config.lora, self.adapter,
                                       self.optimizer_state)
        if ck is None:
            return
        pool_state = ck.trainer_state["pool"]
        self.book.pool.load_state_dict(pool_state)
        if self.ledger is not None and self.group is not None:
            self.ledger.load_state_dict(pool_state)
            # this replica's share of the group's epoch is trained: it holds back, as after
            # its last step of the epoch, until its peers' shares are
            self.group.share_done = self.book.pool.epoch > self.ledger.epoch
        self.optimizer_steps, self.resumed_from = ck.step, str(ck.path)

    # ---- shutdown ---------------------------------------------------------------------------
    def drain(self, timeout_s: float) -> None:
        """Train every captured sample now (a partial last batch included) and wait. Raises
        ``TimeoutError`` after ``timeout_s`` (a hung backward); what it had not committed stays
        uncommitted, to be trained again after a resume. Stops early while a write fails.
        Raises :class:`TrainingFailed` once training gave up (nothing more can be trained)."""
        deadline = time.monotonic() + timeout_s
        while self.has_pending and not self.checkpointer.blocked:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise TimeoutError(f"drain: the backward did not finish step "
                                   f"{self.optimizer_steps} in {timeout_s:.0f} s")
            self.maybe_launch(force=True)
            for outcome in self.backward.wait(left_s):
                self._handle(outcome)
        if self.failure is not None:
            raise self.failure

    def _leave_group(self, deadline: float) -> None:
        """Closing without drain: the captured samples go back untrained, and the replica
        takes part in its peers' steps with empty shares until the group is done."""
        if self.group is None:
            return
        self.book.release_ready()
        while self.failure is None and self.group.share(False, leaving=True) is Share.EMPTY:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise TimeoutError(f"close: the data-parallel group did not finish in time "
                                   f"(step {self.optimizer_steps})")
            if not self.backward.busy:
                self._submit(())
            for outcome in self.backward.wait(left_s):
                self._handle(outcome)

    def close(self, *, drain: bool, checkpoint: bool, timeout_s: float) -> None:
        """Finish (or return) captured samples, stop the process, resolve the job it had in
        flight (committed, or rolled back and released), then checkpoint: adapter, optimizer and
        trainer state always agree. A drain failure is raised after all of this. Data parallel:
        before it stops, the replica sends empty shares until every replica has closed (its
        peers' steps need it), within ``timeout_s``."""
        self._closing = True
        deadline = time.monotonic() + timeout_s
        try:
            if drain:
                self.drain(timeout_s)
            else:
                for outcome in self.backward.wait(timeout_s):
                    self._handle(outcome)
                self._leave_group(deadline)
        finally:
            for outcome in self.backward.stop(timeout_s=min(30.0, timeout_s)):
                self._handle(outcome)
            if self._validation_due is not None:  # owed, never run: say so
                self._validated(ValidationLoss(time.monotonic(), self._validation_due, None, 0,
                                               None, "not run: training stopped first"))
            self.book.release_ready()
            if checkpoint:
                self.save_checkpoint()


@dataclass(frozen=True)
class TorchTrainerFactory:
    """Builds the real trainer over ``model``'s weights, with the grant policy resolved for the
    device the weights live on."""

    model: LlamaModel
    base_model: str
    publish: Publish | None = None
    validation: tuple[TrainingSample, ...] = ()  # held-out samples, validated in the backward

    def __call__(self, config: CoServeConfig, book: SampleBook) -> Trainer:
        b = resolve_policy(config.backward, self.model.weights.device.type == "cuda",
                           torch.get_num_threads())
        return Trainer(replace(config, backward=b), self.model, book,
                       base_model=self.base_model, publish=self.publish,
                       validation=self.validation)
