"""The co-server's :class:`deltaserve.core.contract.TrainingStep`: one planned step's rows and
the hooks its forward calls."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from deltaserve.core.admission import AdmissionPlan
from deltaserve.core.contract import TrainingRows
from deltaserve.train.buffer import ActivationBuffer


@dataclass(frozen=True, eq=False)
class CapturingStep:
    """Captures write into the buffer rows admission reserved for ``plan`` (one contiguous run
    from ``plan.row_start``, in ``rows`` order). ``abort``: the co-server's flag, set by an
    arrival; only an ``abortable`` step reads it."""

    plan: AdmissionPlan
    rows: TrainingRows
    abortable: bool
    buffer: ActivationBuffer
    abort: threading.Event

    @property
    def saves_mlp(self) -> bool:
        return self.buffer.config.saves_mlp

    def capture(self, layer: int, hidden: torch.Tensor) -> None:
        assert hidden.shape[0] == self.rows.num_tokens, (hidden.shape, self.rows.lengths)
        self.buffer.write_residual(layer, self.plan.row_start, hidden)

    def capture_mlp(self, layer: int, gate: torch.Tensor, up: torch.Tensor) -> None:
        if self.saves_mlp:
            self.buffer.write_mlp(layer, self.plan.row_start, gate, up)

    def should_abort(self) -> bool:
        return self.abortable and self.abort.is_set()
