"""Regressors for the attention kernel of one layer, fitted to Vidur's sampled attention rows.

The sampled rows are contiguous windows of an irregular sweep (see the data's README), so a
lookup table would leave holes; a regressor with a physical form fills them. Every coefficient is
fitted non-negative (NNLS), so predictions grow with every input, and in relative terms (each row
weighted by 1/measured), because the times span four orders of magnitude.

Decode (FlashInfer paged decode, one query per sequence)::

    t = a + b · Σ kv_i + c · num_seqs

The kernel is bound by reading the cached K/V: ``Σ kv_i`` tokens of 4 KiB each per layer at TP1
(8 KV heads × 128 × K and V × fp16). ``a`` is the launch and fixed cost, ``c`` the per-sequence
work (query load, partial-result merge). Vidur's ``bs × mean kv`` is the same ``Σ kv_i``.

Prefill of a chunk of ``n`` new tokens behind ``p`` cached ones (FlashInfer prefill)::

    t = a + Σ_chunks (q · n² + x · n·p + m · p + k · n)

Compute is the causal score area ``n²/2 + n·p`` (``q`` and ``x`` separate, because diagonal
tiles are masked and run less efficiently than full ones); memory is reading the prefix's K/V
(``m · p``) and the chunk's own Q/K/V/O (``k · n``). One batched launch pays ``a`` once.

Tensor parallelism splits the heads: at TP ``t`` each GPU holds ``32/t`` query and ``8/t`` KV
heads, so the head-bound work divides by ``t``; but launch costs and some per-token work do not
(the measured TP4 fits keep a TP1-sized per-new-token term). A degree without measured rows (TP2
here) is therefore the geometric mean of its measured neighbours, TP1 and TP4: TP2 sits at the
log-midpoint of 1 and 4, so a term that scales as 1/TP comes out halved and a term that does not
scale comes out unchanged, whichever each term does. The same rule is checked on the MLP
operators, where TP2 is measured (``profiles.GpuProfiles.tp2_rule_check``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from deltaserve.core.nnls import nnls


@dataclass(frozen=True)
class FitError:
    """How well a regressor reproduces the rows it is scored on (relative errors)."""

    num_rows: int
    mape: float
    p90: float
    max_rel: float
    max_abs_ms: float

    @classmethod
    def score(cls, predicted_ms: np.ndarray, measured_ms: np.ndarray) -> FitError:
        rel = np.abs(predicted_ms / measured_ms - 1.0)
        return cls(int(rel.size), float(rel.mean()), float(np.quantile(rel, 0.9)),
                   float(rel.max()), float(np.abs(predicted_ms - measured_ms).max()))


def _relative_nnls(features: np.ndarray, measured_ms: np.ndarray) -> np.ndarray:
    weight = 1.0 / measured_ms
    return nnls(features * weight[:, None], np.ones_like(measured_ms))


@dataclass(frozen=True)
class DecodeFit:
    """Decode attention time of one layer, ms. ``fit_error``: on the rows it was fitted to (or,
    for a derived degree, None)."""

    launch_ms: float
    per_kv_token_ms: float
    per_seq_ms: float
    fit_error: FitError | None = None

    @staticmethod
    def features(num_seqs: np.ndarray, total_kv: np.ndarray) -> np.ndarray:
        return np.column_stack([np.ones_like(total_kv), total_kv, num_seqs])

    @classmethod
    def fit(cls, batch_size: np.ndarray, kv_len: np.ndarray, measured_ms: np.ndarray
            ) -> DecodeFit:
        x = cls.features(batch_size, batch_size * kv_len)
        a, b, c = _relative_nnls(x, measured_ms)
        fitted = cls(float(a), float(b), float(c))
        return replace(fitted, fit_error=FitError.score(
            fitted.predict_rows(batch_size, kv_len), measured_ms))

    def predict_rows(self, batch_size: np.ndarray, kv_len: np.ndarray) -> np.ndarray:
        coef = np.array([self.launch_ms, self.per_kv_token_ms, self.per_seq_ms])
        return self.features(batch_size, batch_size * kv_len) @ coef

    def __call__(self, num_seqs: int, total_kv: int) -> float:
        if num_seqs == 0:
            return 0.0
        return self.launch_ms + self.per_kv_token_ms * total_kv + self.per_seq_ms * num_seqs


@dataclass(frozen=True)
class PrefillFit:
    """Prefill attention time of one layer for a set of chunks ``(new, prefix)``, ms."""

    launch_ms: float
    per_sq_ms: float
    per_cross_ms: float
    per_prefix_ms: float
    per_new_ms: float
    fit_error: FitError | None = None

    @staticmethod
    def features(new: np.ndarray, prefix: np.ndarray) -> np.ndarray:
        return np.column_stack([np.ones_like(new), new * new, new * prefix, prefix, new])

    @classmethod
    def fit(cls, chunk: np.ndarray, prefix: np.ndarray, measured_ms: np.ndarray) -> PrefillFit:
        coef = _relative_nnls(cls.features(chunk, prefix), measured_ms)
        fitted = cls(*map(float, coef))
        return replace(fitted, fit_error=FitError.score(fitted.predict_rows(chunk, prefix),
                                                        measured_ms))

    def _coef(self) -> np.ndarray:
        return np.array([self.launch_ms, self.per_sq_ms, self.per_cross_ms, self.per_prefix_ms,
                         self.per_new_ms])

    def predict_rows(self, chunk: np.ndarray, prefix: np.ndarray) -> np.ndarray:
        """One chunk per row (a batch of one), as the profile measured them."""
        return self.features(chunk, prefix) @ self._coef()

    def __call__(self, chunks: Sequence[tuple[int, int]]) -> float:
        if not chunks:
            return 0.0
        work = sum(self.per_sq_ms * n * n + self.per_cross_ms * n * p + self.per_prefix_ms * p
                   + self.per_new_ms * n for n, p in chunks)
        return self.launch_ms + work


@dataclass(frozen=True)
class GeometricMean:
    """``sqrt(low(...) · high(...))``: a kernel time at the log-midpoint of two measured TP
    degrees (monotone wherever both are)."""

    low: Callable[..., float]
    high: Callable[..., float]

    def __call__(self, *args: object) -> float:
        return math.sqrt(self.low(*args) * self.high(*args))
