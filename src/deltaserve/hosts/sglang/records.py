"""What one scheduler step hands its forward hooks, and what the hooks report back.

Both live in the scheduler process (SGLang runs its scheduler and model runner in one process:
the scheduler calls the model runner directly when the overlap schedule is off), so they are
plain objects, never serialized. The shapes match the vLLM host's ``TrainingRows`` /
``ForwardRecord`` so both hosts can hand the co-server the same step object once the host
contract redesign lands.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deltaserve.core.shape import ExecMode

# (layer, rows [num_tokens, hidden]) -> None: copies one layer's input of the training rows.
Capture = Callable[[int, torch.Tensor], None]


@dataclass
class TrainingRows:
    """The training requests of the step being dispatched, in capture order.

    ``req_ids``: hidden requests whose rows are captured, in this order (the plan's sample order).
    ``lengths``: tokens of each (each must run whole: no prefix hit, no chunk).
    ``capture``: where each layer's rows go. ``should_abort``: asked at every layer boundary
    when ``abortable`` (a training-only step). The hooks set ``valid`` False when the forward
    does not hold every request whole (nothing is then captured) and ``aborted_at`` to the first
    layer not run.
    """

    req_ids: tuple[str, ...]
    lengths: tuple[int, ...]
    capture: Capture
    should_abort: Callable[[], bool] | None = None
    abortable: bool = False
    valid: bool = True
    aborted_at: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


@dataclass(frozen=True)
class ForwardRecord:
    """One forward of the decoder stack (embeddings to final norm; the scheduler's
    :class:`StepTiming` covers logits and sampling too) as the hooks measured it. ``mode``:
    eager when the hooks ran (Python hooks never run inside a CUDA-graph replay; the scheduler
    times those from outside).
    ``layers_run``: decoder layers computed (fewer when a training-only step was cut short)."""

    seconds: float
    mode: ExecMode
    num_tokens: int
    layers_run: int
    aborted: bool = False


@dataclass(frozen=True)
class StepTiming:
    """One ``run_batch`` of the scheduler: its wall time (forward + sampling, synchronous
    scheduling), the SGLang forward mode's name, and the hooks' record of the model forward
    (None when no hook ran: an idle batch or a graph replay)."""

    seconds: float
    forward_mode: str
    num_tokens: int
    forward: ForwardRecord | None
