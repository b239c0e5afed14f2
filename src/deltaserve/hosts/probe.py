"""A stand-in training step for calibration: random training rows whose captures go to a
scratch buffer of the co-server's layout, so a probe times the capture copy too. Every host's
calibration realises its probes' training rows with it."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from deltaserve.core.admission import AdmissionPlan
from deltaserve.core.contract import TrainingRows
from deltaserve.core.shape import StepShape


@dataclass(frozen=True, eq=False)
class ProbeStep:
    """A :class:`~deltaserve.core.contract.TrainingStep` that admitted nothing from a pool: its
    ``rows`` are a probe's, its captures land in ``scratch`` (``[layers, tokens, hidden]``)."""

    plan: AdmissionPlan
    rows: TrainingRows
    scratch: torch.Tensor
    abortable: bool = False
    saves_mlp: bool = False

    def capture(self, layer: int, hidden: torch.Tensor) -> None:
        self.scratch[layer, : hidden.shape[0]].copy_(hidden)

    def capture_mlp(self, layer: int, gate: torch.Tensor, up: torch.Tensor) -> None:
        """Not timed: the calibration buffer keeps the residual stream only."""

    def should_abort(self) -> bool:
        return False


def probe_step(token_ids: tuple[tuple[int, ...], ...], shape: StepShape, dropout: float,
               scratch: torch.Tensor) -> ProbeStep:
    """A probe step of ``shape`` whose training rows are ``token_ids``."""
    rows = TrainingRows(token_ids, dropout, tuple(range(len(token_ids))))
    return ProbeStep(AdmissionPlan((), shape, None, 0.0, None), rows, scratch)


def random_rows(lengths: tuple[int, ...], vocab_size: int, rng: random.Random
                ) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(rng.randrange(vocab_size) for _ in range(n)) for n in lengths)
