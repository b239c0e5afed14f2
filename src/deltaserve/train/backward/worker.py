"""The backward process: a blocking loop over :class:`BackwardJob` (and :class:`EvalJob`)
messages.

It maps the host's base weights, the shared training adapter, the shared optimizer state and the
activation buffer (shared memory on CPU, CUDA IPC on GPU), recomputes each job layer by layer,
clips, steps AdamW on a private copy, then publishes the adapter and optimizer state in place.
Before every layer it waits on the *grant* flag, which the host clears while a prefill-carrying
step runs: inference always wins.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from ctypes import c_byte
from dataclasses import dataclass, field
from multiprocessing.queues import Queue

import torch

from deltaserve.model.config import ModelConfig
from deltaserve.model.llama import BaseWeights, LlamaModel
from deltaserve.model.lora import AdapterWeights, LoRAConfig
from deltaserve.train.backward.allreduce import (
    GradientAllReduce,
    GroupLost,
    ReducedGradient,
    join_group,
)
from deltaserve.train.backward.evaluate import validation_loss
from deltaserve.train.backward.grant import Grant
from deltaserve.train.backward.messages import (
    BackwardDone,
    BackwardFailed,
    BackwardJob,
    EvalDone,
    EvalJob,
    JobSample,
    LayerDone,
    Stop,
    WorkerReady,
)
from deltaserve.train.backward.recompute import (
    HEAD,
    BackwardStats,
    GrantWait,
    layerwise_backward,
)
from deltaserve.train.buffer import ActivationBuffer, BufferConfig
from deltaserve.train.config import DataParallelConfig
from deltaserve.train.optim import OptimizerConfig, OptimizerState, build_adamw
from deltaserve.train.publish import PublishGuard, publish, roll_back

# the synthetic sample each process times its layers on before its first job: long enough that
# a layer's time is its compute (a layer's cost per token at a job's size is then at most it)
_TIMING_TOKENS = 128


@dataclass(frozen=True)
class WorkerSpec:
    """``data_parallel``: with more than one replica, the process joins their group and every
    step's gradient is all-reduced (:mod:`deltaserve.train.backward.allreduce`)."""

    lora: LoRAConfig
    optimizer: OptimizerConfig
    num_threads: int = 1
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)


@dataclass
class SharedState:
    """Everything the backward process maps from its parent."""

    model_config: ModelConfig
    weights: BaseWeights
    adapter_flat: torch.Tensor
    optimizer: OptimizerState
    buffer: ActivationBuffer
    guard: PublishGuard


LayerCallback = Callable[[int], None]
# Data parallel: replaces the gradient (of this replica's mean loss over the given number of
# loss tokens) with the global batch's, in place, summing the job's votes with the peers'.
GradientReduce = Callable[[torch.Tensor, int, BackwardJob], ReducedGradient]


def run_job(model: LlamaModel, trainable: AdapterWeights, opt: torch.optim.Optimizer,
            spec: WorkerSpec, shared: SharedState, job: BackwardJob,
            wait_grant: GrantWait | None = None, on_layer: LayerCallback | None = None,
            allreduce: GradientReduce | None = None) -> BackwardDone:
    """One optimizer step; publishes the adapter and optimizer state when it succeeds. With a
    data-parallel ``allreduce``, the step is the global batch's: the gradient is all-reduced before
    clipping, so the clip, the reported ``grad_norm`` and the AdamW step are the same on every
    replica (the loss and token counts reported stay this replica's). A data-parallel job
    without samples is this replica's empty share: it computes nothing and takes the peers'
    step (none, and publishes nothing, when every share of the step was empty)."""
    t0 = time.perf_counter()
    if job.samples:
        stats = layerwise_backward(model, trainable, shared.buffer, job.samples,
                                   spec.lora.dropout, wait_grant, on_layer)
    elif allreduce is None:
        raise ValueError("an empty backward job: only a data-parallel replica contributes one")
    else:
        stats = BackwardStats(0.0, 0, 0.0)
    trainable.gather_grad_()  # zero where no layer ran
    reduced = ReducedGradient(stats.num_loss_tokens, 0.0)
    if allreduce is not None:
        reduced = allreduce(trainable.flat.grad, stats.num_loss_tokens, job)
        if reduced.num_loss_tokens == 0:  # every replica's share was empty
            opt.zero_grad(set_to_none=True)
            return BackwardDone(job.step, (), 0, 0, 0.0, 0.0, spec.optimizer.lr_at(job.step),
                                time.perf_counter() - t0, stats.paused_s, 0, reduced.seconds,
                                reduced.epoch_open, reduced.staying, stepped=False,
                                group_sample_ids=reduced.group_sample_ids)
    max_norm = spec.optimizer.max_grad_norm
    if max_norm > 0:
        grad_norm = float(torch.nn.utils.clip_grad_norm_([trainable.flat], max_norm))
    else:
        grad_norm = float(trainable.flat.grad.norm())
    lr = spec.optimizer.lr_at(job.step)
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    opt.zero_grad(set_to_none=True)
    publish(job.step, trainable.flat, opt, shared.adapter_flat, shared.optimizer, shared.guard)
    return BackwardDone(job.step, tuple(s.sample_id for s in job.samples), job.num_tokens,
                        stats.num_loss_tokens, stats.loss, grad_norm, lr,
                        time.perf_counter() - t0, stats.paused_s, stats.num_correct,
                        reduced.seconds, reduced.epoch_open, reduced.staying,
                        group_sample_ids=reduced.group_sample_ids)


class _Worker:
    """The process's state: the model over the mapped weights, a private trainable copy of the
    adapter and its AdamW. ``parked`` is 1 whenever the process computes nothing (between jobs,
    or waiting on the grant), so a host that takes the grant back can wait until its cores are
    really free."""

    def __init__(self, spec: WorkerSpec, shared: SharedState, results: Queue, grant: Grant,
                 parked: c_byte):
        self.spec, self.shared, self.results = spec, shared, results
        self.grant, self.parked = grant, parked
        self.model = LlamaModel(shared.model_config, shared.weights)
        self.trainable = AdapterWeights(shared.model_config, spec.lora,
                                        shared.adapter_flat.detach().clone()).make_trainable_()
        self.opt = build_adamw(self.trainable.flat, spec.optimizer, shared.optimizer)
        # the committed adapter, as the host serves it: what validation measures
        self.published = AdapterWeights(shared.model_config, spec.lora, shared.adapter_flat)
        # forms once every replica's backward has started (WorkerReady waits for it)
        self.group: GradientAllReduce | None = join_group(spec.data_parallel,
                                                          self.trainable.flat.device)
        if self.group is not None:
            self.group.check_same_start(self.trainable.flat, shared.optimizer)
        self.parent = mp.parent_process()
        self.step = -1
        self.layer_t0 = time.perf_counter()
        # each unit's compute seconds per unit of work the last time it ran, by (validation
        # job, unit: a layer's index or recompute.LAST_FORWARD/HEAD); the work is a token of a
        # backward job (a layer's cost grows with the job's tokens), one chunk of loss positions
        # for the head (priced as a full chunk), and a whole validation job (the same held-out
        # samples every time)
        self.layer_rate_s: dict[tuple[bool, int], float] = {}
        self.evaluating, self.job_units = False, 1

    def time_layers(self, num_tokens: int = _TIMING_TOKENS) -> None:
        """Time every layer once, on one synthetic sample of ``num_tokens``, before the first
        job: a layer is admitted into a yield by its time, and the first job's longest layer
        (the one through the LM head and the loss) would otherwise start untimed and run past
        the yield it started in. The adapter and its optimizer are left as they were (only the
        gradient is touched, and dropped)."""
        cfg, device = self.shared.model_config, self.trainable.flat.device
        buffer = ActivationBuffer(BufferConfig(num_tokens), cfg, self.shared.buffer.residual.dtype,
                                  device)
        g = torch.Generator(device="cpu").manual_seed(0)
        buffer.residual.copy_(torch.randn(buffer.residual.shape, generator=g))
        labels = torch.randint(0, cfg.vocab_size, (num_tokens,), generator=g).tolist()
        self.evaluating, self.job_units = False, num_tokens
        self.layer_t0 = time.perf_counter()
        layerwise_backward(self.model, self.trainable, buffer,
                           [JobSample(-1, 0, tuple(labels), 0)], 0.0, on_layer=self._timed)
        self.trainable.gather_grad_()
        self.trainable.flat.grad = None

    def _units(self, unit: int) -> int:
        return 1 if unit == HEAD else self.job_units

    def _timed(self, unit: int) -> float:
        """Keep ``unit``'s rate from its compute seconds since ``layer_t0``; those seconds."""
        now = time.perf_counter()
        seconds, self.layer_t0 = now - self.layer_t0, now
        self.layer_rate_s[(self.evaluating, unit)] = seconds / self._units(unit)
        return seconds

    def orphaned(self) -> bool:
        return self.parent is not None and not self.parent.is_alive()

    def wait_grant(self, unit: int) -> float:
        """Wait until the grant admits ``unit`` (its cost: the last run's rate times this job's
        work; every backward unit is timed before the first job, a validation job's layers on
        its first run; the optimizer step, ``unit`` -1, counts as free); the seconds waited.
        While it waits, the grant tells the host what the unit would cost, so the host lends
        no yield too short for it."""
        rate_s = self.layer_rate_s.get((self.evaluating, unit), 0.0)
        layer_s = rate_s * self._units(unit)
        if self.grant.admits(layer_s):
            return 0.0
        t = time.perf_counter()
        self.grant.waiting_s = layer_s
        self.parked.value = 1
        while not self.grant.wait(timeout_s=1.0, layer_s=layer_s):
            if self.orphaned():
                raise SystemExit(0)  # orphaned while paused: nobody will set the grant
        self.parked.value = 0
        self.grant.waiting_s = 0.0
        waited = time.perf_counter() - t
        self.layer_t0 += waited  # a layer's compute time leaves the wait out
        return waited

    def allreduce(self, grad: torch.Tensor, num_loss_tokens: int,
                  job: BackwardJob) -> ReducedGradient:
        """The step's all-reduce. Waiting there for the slowest peer computes nothing, so the
        process counts as parked (a host step need not wait for it); afterwards it waits for
        the grant like before a layer, so the optimizer step never runs beside a host step
        that took the grant back meanwhile."""
        assert self.group is not None
        self.parked.value = 1
        try:
            reduced = self.group.reduce_(grad, num_loss_tokens, job.epoch_open, job.staying,
                                         tuple(s.sample_id for s in job.samples))
        finally:
            self.parked.value = 0
        self.wait_grant(-1)
        return reduced

    def on_layer(self, layer: int) -> None:
        self.results.put(LayerDone(self.step, layer, self._timed(layer)))

    def run(self, job: BackwardJob | EvalJob) -> None:
        self.parked.value = 0  # computing; it checks the grant before its first layer
        self.step, self.layer_t0 = job.step, time.perf_counter()
        self.evaluating = isinstance(job, EvalJob)
        self.job_units = 1 if isinstance(job, EvalJob) else max(1, job.num_tokens)
        done: BackwardDone | EvalDone
        try:
            if isinstance(job, EvalJob):
                done = validation_loss(self.model, self.published, job, self.wait_grant,
                                       self.on_layer)
            else:
                done = run_job(self.model, self.trainable, self.opt, self.spec, self.shared,
                               job, self.wait_grant, self.on_layer,
                               self.allreduce if self.group is not None else None)
        except Exception as e:
            self.parked.value = 1
            if isinstance(job, BackwardJob):  # validation changes nothing to undo
                self.recover(job.step)
            self.results.put(BackwardFailed(job.step, traceback.format_exc(),
                                            group_lost=isinstance(e, GroupLost)))
            return
        self.parked.value = 1
        self.results.put(done)

    def recover(self, step: int) -> None:
        """The committed state is the truth: undo a half-done publish and drop the half-made
        step from the private copies (the optimizer's moments included)."""
        sh = self.shared
        roll_back(step, sh.adapter_flat, sh.optimizer, sh.guard)
        with torch.no_grad():
            self.trainable.flat.copy_(sh.adapter_flat)
        self.trainable.flat.grad = None
        self.opt = build_adamw(self.trainable.flat, self.spec.optimizer, sh.optimizer)


def worker_main(spec: WorkerSpec, shared: SharedState, jobs: Queue, results: Queue, grant: Grant,
                parked: c_byte) -> None:
    """The process's entry point: report ready, then run jobs until ``Stop`` or orphaned."""
    torch.set_num_threads(spec.num_threads)
    worker = _Worker(spec, shared, results, grant, parked)
    worker.time_layers()
    results.put(WorkerReady(os.getpid()))
    while True:
        try:
            msg = jobs.get(timeout=1.0)
        except queue.Empty:
            if worker.orphaned():
                return  # orphaned: nobody will read the results
            continue
        if isinstance(msg, Stop):
            if worker.group is not None:
                worker.group.close()
            return
        worker.run(msg)
