"""The co-server: the host-agnostic implementation of :class:`deltaserve.core.CoServingHooks`.

It owns the policy (latency model, admission, sample pool, buffer ledger) and the training side
(activation buffer, backward process, checkpoints). A host adapter calls, for every step::

    plan = co.plan(view)            # Algorithm 1 on the host's proposed batch
    co.begin_step(plan)             # clears the grant for prefill-carrying steps
    ... forward: co.capture(layer, rows) and co.should_abort() at each layer boundary ...
    co.observe(StepReport(...))     # refit, retire samples, launch the backward

and ``co.on_arrival()`` whenever a client request arrives.

Sample lifecycle: admitted (claimed, rows reserved) → captured (forward done, ready) → in the
backward → committed (adapter updated, rows freed). An aborted step or a failed/lost backward
releases its samples back to the pool, so each is trained exactly once per epoch.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from deltaserve.core.admission import (
    AdmissionPlan,
    AdmissionScheduler,
    SchedulingView,
    Skip,
)
from deltaserve.core.buffer_ledger import BufferLedger
from deltaserve.core.calibration import HostLimits
from deltaserve.core.contract import StepReport
from deltaserve.core.data import TrainingSample
from deltaserve.core.errors import require
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.pool import SamplePool
from deltaserve.model.llama import LlamaModel
from deltaserve.model.lora import AdapterWeights, DropoutSegment, LoRAGroup
from deltaserve.train.backward_process import BackwardProcess, WorkerLost
from deltaserve.train.buffer import ActivationBuffer, BufferConfig
from deltaserve.train.checkpoint import CheckpointStore, TrainingLog, dataset_fingerprint
from deltaserve.train.coserve_config import Commit, CoServeConfig, CoServeStats
from deltaserve.train.messages import BackwardDone, BackwardFailed, BackwardJob, JobSample
from deltaserve.train.optim import OptimizerState
from deltaserve.train.publish import PublishGuard
from deltaserve.train.worker import SharedState, WorkerSpec


class CoServer:
    def __init__(self, config: CoServeConfig, limits: HostLimits, model: LlamaModel,
                 samples: Sequence[TrainingSample], *, base_model: str,
                 latency_model: LatencyModel | None = None,
                 on_publish: Callable[[AdapterWeights], None] | None = None,
                 scheduler_cls: type[AdmissionScheduler] = AdmissionScheduler):
        longest = max(s.num_tokens for s in samples) if samples else 0
        cap = config.buffer_tokens or config.backward_batch_tokens + longest
        require(longest <= cap, "buffer_tokens", cap, f"cannot hold the longest sample "
                f"({longest} tokens); raise it or lower the dataset's max_tokens")
        require(longest <= limits.max_tokens_per_step, "max_tokens", longest,
                f"a sample must fit one step of {limits.max_tokens_per_step} tokens")
        require(longest <= limits.max_model_len, "max_tokens", longest,
                f"a sample must fit the model's context of {limits.max_model_len}")
        if config.grant_policy == "auto":
            on_gpu = model.weights.device.type == "cuda"
            config = replace(config, grant_policy="prefill" if on_gpu else "inference")
        if config.backward_threads is None:
            config = replace(config, backward_threads=torch.get_num_threads()
                             if config.grant_policy == "inference" else 1)
        self.config = config
        self.limits = limits
        self.model = model
        self.samples = list(samples)
        self.base_model = base_model
        self.on_publish = on_publish
        self.fingerprint = dataset_fingerprint(self.samples)
        device = model.weights.device

        self.adapter = AdapterWeights(model.config, config.lora, device=device)
        self.adapter.init_peft_(config.seed)
        self.optimizer_state = OptimizerState(self.adapter.numel)
        self.pool = SamplePool([s.num_tokens for s in self.samples],
                               num_epochs=config.num_epochs, seed=config.seed)
        self.ledger = BufferLedger(cap)
        self.buffer = ActivationBuffer(BufferConfig(cap, config.buffer_save,
                                                    config.buffer_offload),
                                       model.config, model.weights.dtype, device)
        self.latency = latency_model or LatencyModel(config.latency)
        self.scheduler = scheduler_cls(config.admission, config.slo, limits, self.latency,
                                       self.pool, self.ledger)
        self.log = TrainingLog(
            f"{config.checkpoint.root}/train_log.jsonl" if config.checkpoint.root else None)
        self.optimizer_steps = 0
        self.resumed_from: str | None = None
        self.checkpoints = (CheckpointStore(config.checkpoint.root, config.checkpoint.keep)
                            if config.checkpoint.root else None)
        if self.checkpoints is not None:
            self.checkpoints.clean_stale()  # what a crash mid-save left
            if config.checkpoint.resume:
                self._resume(self.checkpoints)

        if device.type == "cpu":
            model.weights.share_memory_()
            self.adapter.share_memory_()
        self.optimizer_state.share_memory_()
        self.backward = BackwardProcess(
            WorkerSpec(config.lora, config.optimizer, config.backward_threads),
            SharedState(model.config, model.weights, self.adapter.flat, self.optimizer_state,
                        self.buffer,
                        PublishGuard(self.adapter.flat, self.adapter.numel).share_memory_()))
        self.backward.wait_ready()

        self._plan: AdmissionPlan | None = None
        self._abortable = False
        self._abort = threading.Event()
        self._seeds: dict[int, int] = {}
        self._ready: list[JobSample] = []
        self._skips: Counter[Skip] = Counter()
        self._counts = Counter()
        self._last_loss: float | None = None
        self.commits: list[Commit] = []
        # inference never shares cores with the backward: it runs in yields and idle time
        self._exclusive = config.grant_policy == "inference"
        self._layer_s = 0.05  # backward seconds per layer, measured once jobs complete

    # ---- the host contract ----------------------------------------------------------------
    def plan(self, view: SchedulingView) -> AdmissionPlan:
        self.poll()
        room = self.config.backward_batch_tokens - sum(s.length for s in self._ready)
        plan = self.scheduler.plan(view, backward_running=self.backward.busy,
                                   batch_room_tokens=room)
        epoch = self.pool.epoch
        for s in plan.samples:
            self._seeds[s.sample_id] = _dropout_seed(self.config.seed, epoch, s.sample_id)
        if plan.skip is not None:
            self._skips[plan.skip] += 1
        self._plan = plan
        return plan

    def begin_step(self, plan: AdmissionPlan) -> None:
        s = plan.shape
        if self._exclusive:
            # the step gets every core: stop the backward and wait out its current layer
            self.backward.grant.clear()
            self.backward.wait_parked(3 * self._layer_s)
        elif self.config.grant_policy == "prefill" and (s.prefill_lens or s.ft_lens):
            self.backward.grant.clear()
        self._abortable = bool(plan.samples) and not s.has_inference

    def capture(self, layer: int, hidden_rows: torch.Tensor) -> None:
        """Rows of the admitted samples, in plan order: one contiguous run of the buffer."""
        assert self._plan is not None and self._plan.samples
        self.buffer.write_residual(layer, self._plan.samples[0].rows.start, hidden_rows)

    def capture_mlp(self, layer: int, gate_rows: torch.Tensor, up_rows: torch.Tensor) -> None:
        assert self._plan is not None and self._plan.samples
        if self.buffer.config.saves_mlp:
            self.buffer.write_mlp(layer, self._plan.samples[0].rows.start, gate_rows, up_rows)

    def should_abort(self) -> bool:
        return self.config.interrupt and self._abortable and self._abort.is_set()

    def observe(self, report: StepReport) -> None:
        if not self._exclusive:
            self.backward.grant.set()  # decode steps may overlap the backward
        plan = report.plan
        if report.aborted:
            self._release([s.sample_id for s in plan.samples])
            self._counts["aborted_steps"] += 1
        else:
            if not report.shape.is_empty:
                self.latency.observe(report.shape, report.seconds)
                self.scheduler.observe(report.shape, report.seconds)
            for s in plan.samples:
                self._ready.append(JobSample(s.sample_id, s.rows.start,
                                             self.samples[s.sample_id].labels,
                                             self._seeds[s.sample_id]))
            if plan.samples:
                self._counts["steps_with_ft"] += 1
                self._counts["ft_tokens_forwarded"] += plan.num_ft_tokens
        self._plan = None
        self._abortable = False
        self._abort.clear()
        self._maybe_launch()

    def on_arrival(self) -> None:
        self._abort.set()

    # ---- what a host needs to run the training rows -----------------------------------------
    def training_tokens(self, plan: AdmissionPlan) -> list[tuple[int, ...]]:
        return [self.samples[s.sample_id].input_ids for s in plan.samples]

    def training_lora(self, plan: AdmissionPlan, rows: slice | torch.Tensor) -> LoRAGroup:
        """The reserved training adapter on ``rows``, with each sample's dropout seed."""
        segments, offset = [], 0
        for s in plan.samples:
            segments.append(DropoutSegment(offset, s.num_tokens, self._seeds[s.sample_id]))
            offset += s.num_tokens
        return LoRAGroup(self.adapter, rows, self.config.lora.dropout, tuple(segments))

    # ---- the backward -----------------------------------------------------------------------
    def poll(self, timeout_s: float = 0.0) -> None:
        for ev in self.backward.poll(timeout_s):
            if isinstance(ev, BackwardDone):
                self._commit(ev)
            elif isinstance(ev, BackwardFailed):
                self._counts["backward_failures"] += 1
                self.log.write({"step": ev.step, "error": ev.error})
                self._release_job(self._lost_job)
            elif isinstance(ev, WorkerLost):
                self._counts["worker_restarts"] += 1
                rolled = "; the half-published step was rolled back" if ev.rolled_back else ""
                self.log.write({"step": ev.job.step, "error": f"backward process died "
                                f"(exit code {ev.exitcode}); its samples return to the "
                                f"pool{rolled}"})
                self._release_job(ev.job)
        self._maybe_launch()

    # ---- giving the backward the machine (exclusive policy) ---------------------------------
    def yield_budget_s(self, view: SchedulingView) -> float:
        """How long the host may pause before running ``view.proposed`` so the backward can
        work, keeping every request inside its SLO: the admission policy's slack after the
        predicted step, less the backward's stop latency (it stops at a layer boundary)."""
        if not (self._exclusive and self.config.yield_to_backward and self.backward.busy):
            return 0.0
        usable = self.scheduler.yield_budget_s(view) - 2 * self._layer_s
        return min(usable, self.config.max_yield_s) if usable >= 2 * self._layer_s else 0.0

    def yield_to_backward(self, seconds: float, wake: threading.Event) -> float:
        """Let the backward run for ``seconds`` or until ``wake`` is set (a request arrived);
        returns the time given. The next ``begin_step`` takes the machine back."""
        t0 = time.monotonic()
        self.backward.grant.set()
        wake.wait(seconds)
        self._counts["yields"] += 1
        self.poll()
        return time.monotonic() - t0

    def idle(self, timeout_s: float) -> None:
        """The host has nothing to run: the backward may use the machine meanwhile."""
        self.backward.grant.set()
        self.poll(timeout_s=timeout_s)

    @property
    def backward_busy(self) -> bool:
        return self.backward.busy

    @property
    def has_pending_training(self) -> bool:
        """Samples captured or in the backward but not yet committed."""
        return bool(self._ready) or self.backward.busy

    def _can_admit_more(self) -> bool:
        smallest = self.pool.smallest_available()
        return smallest is not None and smallest <= self.ledger.largest_free_run

    def _maybe_launch(self, force: bool = False) -> None:
        if self.backward.busy or not self._ready:
            return
        tokens = sum(s.length for s in self._ready)
        if not (force or tokens >= self.config.backward_batch_tokens
                or not self._can_admit_more()):
            return
        take, n = [], 0
        while self._ready and n < self.config.backward_batch_tokens:
            s = self._ready.pop(0)
            take.append(s)
            n += s.length
        job = BackwardJob(self.optimizer_steps, tuple(take))
        self._lost_job = job
        self.backward.submit(job)

    def _commit(self, ev: BackwardDone) -> None:
        per_layer = max(ev.wall_s - ev.paused_s, 0.0) / self.model.num_layers
        self._layer_s = 0.7 * self._layer_s + 0.3 * per_layer
        ids = list(ev.sample_ids)
        epoch = self.pool.epoch
        self.pool.commit(ids)
        for sid in ids:
            self.ledger.free(sid)
            self._seeds.pop(sid, None)
        self.optimizer_steps = ev.step + 1
        self._last_loss = ev.loss
        self.commits.append(Commit(time.monotonic(), epoch, ev))
        self.log.write({"step": ev.step, "epoch": epoch, "sample_ids": ids,
                        "num_tokens": ev.num_tokens, "num_loss_tokens": ev.num_loss_tokens,
                        "loss": ev.loss, "grad_norm": ev.grad_norm, "lr": ev.lr,
                        "wall_s": ev.wall_s, "paused_s": ev.paused_s})
        if self.on_publish is not None:
            self.on_publish(self.adapter)
        ck = self.config.checkpoint
        if ck.root and (self.optimizer_steps % ck.every_steps == 0
                        or self.pool.progress().finished):
            self.save_checkpoint()  # periodically, and once the last epoch is trained

    def _release(self, ids: list[int]) -> None:
        if not ids:
            return
        self.pool.release(ids)
        for sid in ids:
            self.ledger.free(sid)
            self._seeds.pop(sid, None)

    def _release_job(self, job: BackwardJob) -> None:
        self._release([s.sample_id for s in job.samples])

    # ---- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self) -> str | None:
        """Write the adapter, optimizer and pool progress as of the last committed step."""
        if self.checkpoints is None:
            return None
        path = self.checkpoints.save(self.optimizer_steps, self.adapter, self.optimizer_state,
                                     self.pool.state_dict(), self.base_model, self.fingerprint)
        return str(path)

    def _resume(self, store: CheckpointStore) -> None:
        resumed = store.resume(self.model.config)
        if resumed is None:
            return
        ck = resumed.checkpoint
        latest = ck.path
        require(ck.trainer_state["dataset_fingerprint"] == self.fingerprint, "resume",
                str(latest), "the checkpoint was made on another dataset or tokenization")
        require(ck.adapter.config == self.config.lora, "resume", str(latest),
                f"the checkpoint's LoRA config {ck.adapter.config} differs from "
                f"{self.config.lora}")
        with torch.no_grad():
            self.adapter.flat.copy_(ck.adapter.flat)
        self.optimizer_state.load_state_dict_(ck.optimizer)
        self.pool.load_state_dict(ck.trainer_state["pool"])
        self.optimizer_steps = ck.step
        self.resumed_from = str(latest)

    # ---- lifecycle --------------------------------------------------------------------------
    def drain(self, timeout_s: float = 600.0) -> None:
        """Train every captured sample now (a partial last batch included) and wait. Raises
        ``TimeoutError`` if the backward has not finished in ``timeout_s`` (a hung process);
        what it had not committed stays uncommitted, to be trained again after a resume."""
        self.backward.grant.set()  # nothing else runs: the backward has the machine
        deadline = time.monotonic() + timeout_s
        while self.has_pending_training:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                step = self.backward.in_flight.step if self.backward.in_flight else None
                raise TimeoutError(f"drain: the backward did not finish step {step} in "
                                   f"{timeout_s:.0f} s")
            self._maybe_launch(force=True)
            for ev in self.backward.wait(left_s):
                self._dispatch(ev)

    def _dispatch(self, ev) -> None:
        if isinstance(ev, BackwardDone):
            self._commit(ev)
        elif isinstance(ev, BackwardFailed):
            self._counts["backward_failures"] += 1
            self._release_job(self._lost_job)
        elif isinstance(ev, WorkerLost):
            self._counts["worker_restarts"] += 1
            self._release_job(ev.job)

    def close(self, *, drain: bool = True, checkpoint: bool = True,
              timeout_s: float = 600.0) -> None:
        """Stop training cleanly: finish (or return) captured samples, stop, checkpoint. The
        process is stopped and the checkpoint (of the last committed step) written even when
        draining fails; the failure is raised after."""
        try:
            if drain:
                self.drain(timeout_s)
            else:
                self.backward.grant.set()
                for ev in self.backward.wait(timeout_s):
                    self._dispatch(ev)
                self._release([s.sample_id for s in self._ready])
                self._ready.clear()
        finally:
            # first: a process still running could publish mid-save
            self.backward.stop(timeout_s=min(30.0, timeout_s))
            if checkpoint:
                self.save_checkpoint()

    def stats(self) -> CoServeStats:
        p = self.pool.progress()
        return CoServeStats(p.tokens_committed_total, p.samples_committed_total,
                            self._counts["ft_tokens_forwarded"], self.optimizer_steps,
                            self._counts["steps_with_ft"], self._counts["aborted_steps"],
                            self._counts["backward_failures"], self._counts["worker_restarts"],
                            p.epoch, self._last_loss, dict(self._skips))


def _dropout_seed(seed: int, epoch: int, sample_id: int) -> int:
    return (seed * 2_654_435_761 + epoch * 40_503 + sample_id) % (2**61 - 1)
