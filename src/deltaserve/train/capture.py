"""A training-only forward through the contract, with no host: what a host does for the
training rows of a step. Benchmarks and tests use it; hosts run the same model code inside their
own batches."""

from __future__ import annotations

import time

import torch

from deltaserve.core.admission import SchedulingView
from deltaserve.core.contract import CoServingHooks, StepReport, TrainingStep
from deltaserve.core.shape import StepShape
from deltaserve.model.attention import CausalSegments, attention_kernels
from deltaserve.model.llama import ForwardContext, LlamaModel
from deltaserve.model.lora import AdapterWeights, training_group


class StepAborted(Exception):
    """Raised at a layer boundary when the co-server asks a training-only step to stop."""

    def __init__(self, layers_run: int):
        super().__init__(f"aborted after {layers_run} layers")
        self.layers_run = layers_run


def forward_training_rows(model: LlamaModel, step: TrainingStep, adapter: AdapterWeights) -> int:
    """Forward ``step.rows`` (each sample from position 0) on ``adapter``, capturing each layer's
    input through the step's hooks. Returns the layers run; raises :class:`StepAborted`."""
    rows = step.rows
    ids = torch.tensor(rows.flat_token_ids(), dtype=torch.long, device=model.weights.device)
    positions = torch.tensor(rows.positions(), dtype=torch.long, device=ids.device)
    mlp_hook = step.capture_mlp if step.saves_mlp else None
    ctx = ForwardContext(positions, CausalSegments(rows.lengths, ids.device),
                         (training_group(adapter, slice(0, len(ids)), rows),), mlp_hook=mlp_hook)

    def hook(layer: int, h: torch.Tensor) -> None:
        if step.should_abort():
            raise StepAborted(layer)
        step.capture(layer, h)

    with torch.no_grad(), attention_kernels(ids.device):
        model.forward(ids, ctx, hook)
    if ids.is_cuda:
        # the backward process reads the buffer on streams of its own (CUDA orders no work
        # across processes), and the caller times the step: both need the captures landed
        torch.cuda.synchronize(ids.device)
    return model.num_layers


def training_only_step(co: CoServingHooks, model: LlamaModel, adapter: AdapterWeights,
                       now_s: float = 0.0) -> TrainingStep | None:
    """Plan, forward and observe one step with no inference work, as an idle host does.
    Returns the step (``None`` when nothing was admitted)."""
    step = co.plan(SchedulingView(StepShape(), now_s))
    if not step.rows.num_samples:
        co.observe(StepReport(step, step.plan.shape, 0.0))
        return None
    t0 = time.perf_counter()
    aborted, layers = False, model.num_layers
    try:
        forward_training_rows(model, step, adapter)
    except StepAborted as e:
        aborted, layers = True, e.layers_run
    co.observe(StepReport(step, step.plan.shape, time.perf_counter() - t0, aborted, layers))
    return step
