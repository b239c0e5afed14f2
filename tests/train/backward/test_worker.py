"""The backward process's worker, in this process: it times every layer before its first job,
leaving the adapter and its optimizer state as they were, and a grant lent until a deadline
admits a layer only by that time, telling the host meanwhile what the layer would cost."""

import threading
import time
from ctypes import c_byte

import torch
import torch.multiprocessing as mp

from deltaserve.model import AdapterWeights, LlamaModel, LoRAConfig
from deltaserve.model.loading import load_weights
from deltaserve.train.backward import recompute
from deltaserve.train.backward.grant import Grant
from deltaserve.train.backward.worker import SharedState, WorkerSpec, _Worker
from deltaserve.train.buffer import ActivationBuffer, BufferConfig
from deltaserve.train.optim import OptimizerConfig, OptimizerState
from deltaserve.train.publish import PublishGuard

LORA = LoRAConfig(r=4, alpha=8)


def worker(base_path) -> _Worker:
    model = LlamaModel(*load_weights(base_path))
    adapter = AdapterWeights(model.config, LORA).init_peft_(3)
    with torch.no_grad():  # non-zero B: the synthetic backward reaches every matrix
        adapter.flat.add_(torch.randn(adapter.numel,
                                      generator=torch.Generator().manual_seed(4)) * 0.05)
    optimizer = OptimizerState(adapter.numel)
    shared = SharedState(model.config, model.weights, adapter.flat, optimizer,
                         ActivationBuffer(BufferConfig(64), model.config, torch.float32),
                         PublishGuard(adapter.flat, adapter.numel))
    ctx = mp.get_context("spawn")
    return _Worker(WorkerSpec(LORA, OptimizerConfig()), shared, ctx.Queue(), Grant(ctx),
                   ctx.Value(c_byte, 1, lock=False))


def test_every_layer_is_timed_before_the_first_job_and_nothing_else_changes(base_path):
    w = worker(base_path)
    flat, state = w.trainable.flat.detach().clone(), w.shared.optimizer.exp_avg.clone()
    published = w.shared.adapter_flat.clone()
    w.time_layers(32)
    layers = w.model.num_layers
    units = (recompute.LAST_FORWARD, recompute.HEAD, *range(layers))
    assert sorted(w.layer_rate_s) == [(False, u) for u in units]
    assert all(rate > 0 for rate in w.layer_rate_s.values())
    assert torch.equal(w.trainable.flat.detach(), flat) and w.trainable.flat.grad is None
    assert torch.equal(w.shared.optimizer.exp_avg, state)
    assert torch.equal(w.shared.adapter_flat, published)
    assert w.results.empty()  # timing is not a job: the host hears nothing of it


def test_a_layer_that_would_end_past_the_grants_deadline_waits_for_the_next_grant(base_path):
    w = worker(base_path)
    w.time_layers(32)
    w.job_units = 32
    last = w.model.num_layers - 1  # through the LM head and the loss
    layer_s = w.layer_rate_s[(False, last)] * w.job_units
    w.grant.set(until_s=time.monotonic() + 1000 * layer_s)
    assert w.wait_grant(last) == 0.0  # it ends well before the deadline
    w.grant.set(until_s=time.monotonic() + layer_s / 2)  # it would end after the deadline
    seen: list[float] = []  # what the host reads while the worker waits
    threading.Timer(0.1, lambda: seen.append(w.grant.waiting_s)).start()
    threading.Timer(0.2, w.grant.set).start()  # the next grant has no deadline
    assert w.wait_grant(last) >= 0.2
    assert w.parked.value == 0  # computing again
    assert seen == [layer_s] and w.grant.waiting_s == 0.0
