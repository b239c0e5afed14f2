"""The latency model's equations: which one prices a step, its regressors, and the bounded
rows that hold observed (regressors, seconds) (see :mod:`deltaserve.core.latency_model` for the
equations themselves)."""

from __future__ import annotations

from enum import StrEnum

import numpy as np

from deltaserve.core.shape import StepShape


class Equation(StrEnum):
    MIXED = "mixed"  # Equation I: prefill or fine-tuning tokens present
    DECODE = "decode"  # Equation II: decode tokens only


TERMS: dict[Equation, tuple[str, ...]] = {
    Equation.MIXED: ("alpha", "beta", "gamma", "epsilon", "c", "zeta"),
    Equation.DECODE: ("beta", "epsilon", "c"),
}


def equation_of(shape: StepShape) -> Equation:
    return Equation.DECODE if shape.is_decode_only else Equation.MIXED


def features(shape: StepShape, equation: Equation | None = None) -> tuple[float, ...]:
    """The regressors of ``shape`` under ``equation`` (its own equation by default)."""
    equation = equation or equation_of(shape)
    if equation is Equation.DECODE:
        return (float(shape.num_decode), float(shape.kv_tokens), 1.0)
    inference_rows = float(shape.num_prefill_tokens + shape.num_decode)
    return (
        float(shape.prefill_sq_tokens),
        inference_rows,
        float(shape.num_ft_tokens),
        float(shape.kv_tokens),
        1.0,
        inference_rows if shape.ft_lens else 0.0,
    )


class FeatureRing:
    """Fixed-capacity ring of (features..., seconds) rows."""

    def __init__(self, capacity: int, width: int):
        self.rows = np.zeros((capacity, width + 1))
        self.size = 0
        self.head = 0

    def push(self, x: tuple[float, ...], seconds: float) -> None:
        self.rows[self.head, :-1] = x
        self.rows[self.head, -1] = seconds
        self.head = (self.head + 1) % len(self.rows)
        self.size = min(self.size + 1, len(self.rows))

    def data(self) -> np.ndarray:
        return self.rows[: self.size] if self.size < len(self.rows) else self.rows
