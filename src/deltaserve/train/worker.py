"""The backward process: a blocking loop over :class:`BackwardJob` messages.

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
from dataclasses import dataclass
from typing import Any

import torch

from deltaserve.model.config import ModelConfig
from deltaserve.model.llama import BaseWeights, LlamaModel
from deltaserve.model.lora import AdapterWeights, LoRAConfig
from deltaserve.train.buffer import ActivationBuffer
from deltaserve.train.grant import Grant
from deltaserve.train.messages import BackwardDone, BackwardFailed, BackwardJob, Stop, WorkerReady
from deltaserve.train.optim import OptimizerConfig, OptimizerState, build_adamw
from deltaserve.train.publish import PublishGuard, publish, roll_back
from deltaserve.train.recompute import layerwise_backward


@dataclass(frozen=True)
class WorkerSpec:
    lora: LoRAConfig
    optimizer: OptimizerConfig
    num_threads: int = 1


@dataclass
class SharedState:
    """Everything the backward process maps from its parent."""

    model_config: ModelConfig
    weights: BaseWeights
    adapter_flat: torch.Tensor
    optimizer: OptimizerState
    buffer: ActivationBuffer
    guard: PublishGuard


def run_job(model: LlamaModel, trainable: AdapterWeights, opt: torch.optim.Optimizer,
            spec: WorkerSpec, shared: SharedState, job: BackwardJob, wait_grant=None,
            on_layer=None) -> BackwardDone:
    """One optimizer step; publishes the adapter and optimizer state when it succeeds."""
    t0 = time.perf_counter()
    stats = layerwise_backward(model, trainable, shared.buffer, job.samples, spec.lora.dropout,
                               wait_grant, on_layer)
    trainable.gather_grad_()
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
                        time.perf_counter() - t0, stats.paused_s)


def worker_main(spec: WorkerSpec, shared: SharedState, jobs: Any, results: Any, grant: Grant,
                layers_done: Any, parked: Any) -> None:
    """``parked`` is 1 whenever the process computes nothing (between jobs, or waiting on the
    grant), so a host that clears the grant can wait until its cores are really free."""
    torch.set_num_threads(spec.num_threads)
    model = LlamaModel(shared.model_config, shared.weights)
    trainable = AdapterWeights(shared.model_config, spec.lora,
                               shared.adapter_flat.detach().clone()).make_trainable_()
    opt = build_adamw(trainable.flat, spec.optimizer, shared.optimizer)

    parent = mp.parent_process()

    def wait_grant(layer: int) -> float:
        if grant.is_set():
            return 0.0
        t = time.perf_counter()
        parked.value = 1
        while not grant.wait(timeout_s=1.0):
            if parent is not None and not parent.is_alive():
                raise SystemExit(0)  # orphaned while paused: nobody will set the grant
        parked.value = 0
        return time.perf_counter() - t

    def on_layer(layer: int) -> None:
        layers_done.value += 1

    results.put(WorkerReady(os.getpid()))
    while True:
        try:
            msg = jobs.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return  # orphaned: nobody will read the results
            continue
        if isinstance(msg, Stop):
            return
        parked.value = 0  # computing; it checks the grant before its first layer
        try:
            done = run_job(model, trainable, opt, spec, shared, msg, wait_grant, on_layer)
            parked.value = 1
            results.put(done)
        except Exception:
            parked.value = 1
            # the committed state is the truth: undo a half-done publish, drop the half-made
            # step from the private copies (the optimizer's moments included)
            roll_back(msg.step, shared.adapter_flat, shared.optimizer, shared.guard)
            with torch.no_grad():
                trainable.flat.copy_(shared.adapter_flat)
            trainable.flat.grad = None
            opt = build_adamw(trainable.flat, spec.optimizer, shared.optimizer)
            results.put(BackwardFailed(msg.step, traceback.format_exc()))
