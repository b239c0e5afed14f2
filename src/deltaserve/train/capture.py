"""A training-only forward that captures activations: what a host does for the training rows of
a step, without the host. Benchmarks and tests use it; hosts run the same model code inside
their own batches."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from deltaserve.model.attention import CausalSegments
from deltaserve.model.llama import ForwardContext, LlamaModel
from deltaserve.model.lora import LoRAGroup


class StepAborted(Exception):
    """Raised at a layer boundary when the co-server asks a training-only step to stop."""

    def __init__(self, layers_run: int):
        super().__init__(f"aborted after {layers_run} layers")
        self.layers_run = layers_run


def forward_training_rows(model: LlamaModel, token_ids: Sequence[Sequence[int]],
                          make_group: Callable[[slice], LoRAGroup],
                          capture: Callable[[int, torch.Tensor], None],
                          capture_mlp: Callable[[int, torch.Tensor, torch.Tensor], None] | None
                          = None, should_abort: Callable[[], bool] | None = None) -> int:
    """Forward the samples (end to end, each from position 0) with their training adapter,
    capturing each layer's input. Returns the layers run; raises :class:`StepAborted`."""
    ids = torch.tensor([t for s in token_ids for t in s], dtype=torch.long,
                       device=model.weights.device)
    lengths = [len(s) for s in token_ids]
    positions = torch.cat([torch.arange(n) for n in lengths]).to(ids.device)
    ctx = ForwardContext(positions, CausalSegments(lengths), (make_group(slice(0, len(ids))),),
                         mlp_hook=capture_mlp)

    def hook(layer: int, h: torch.Tensor) -> None:
        if should_abort is not None and should_abort():
            raise StepAborted(layer)
        capture(layer, h)

    with torch.no_grad():
        model.forward(ids, ctx, hook)
    return model.num_layers


def training_only_step(co, model: LlamaModel, now_s: float = 0.0):
    """Plan, forward and observe one step with no inference work, as a host's idle loop does.
    Returns the plan (``None`` when nothing was admitted)."""
    import time

    from deltaserve.core.admission import SchedulingView
    from deltaserve.core.contract import StepReport
    from deltaserve.core.shape import StepShape

    plan = co.plan(SchedulingView(StepShape(), now_s))
    if not plan.samples:
        return None
    co.begin_step(plan)
    t0 = time.perf_counter()
    aborted, layers = False, model.num_layers
    try:
        forward_training_rows(model, co.training_tokens(plan),
                              lambda rows: co.training_lora(plan, rows), co.capture,
                              co.capture_mlp, co.should_abort)
    except StepAborted as e:
        aborted, layers = True, e.layers_run
    co.observe(StepReport(plan, plan.shape, time.perf_counter() - t0, aborted, layers))
    return plan
