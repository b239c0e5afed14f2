"""Monotone curves over a count (tokens, elements) from measured medians.

A GPU's measured time is not monotone in the token count at the 2 % level: a GEMM that crosses a
tile or kernel-selection boundary can be up to ~10 % faster at ``n + 8`` tokens than at ``n``
(Vidur's A100 profile has such dips; their repeat-to-repeat spread is ~1 %, so they are
systematic, not noise). A simulator whose step time can fall when a token is added makes the
admission loop ("add samples while the predicted time fits") and any latency fit chase kernel
heuristics, so the oracle's curves are monotone by construction.

The fit is the L∞ isotonic regression in log space: with ``U_i`` the running maximum of the
log-medians up to point ``i`` and ``L_i`` the running minimum from ``i`` on, the curve passes
through ``exp((U_i + L_i) / 2)``. Where the data are locally monotone (``U_i = L_i``) it goes
through the measured point exactly; at a dip its relative error is ``sqrt(U_i / L_i) - 1``, the
least worst-case error any monotone curve can have over that dip. Between measured points the
curve is linear (so it stays monotone); below the first point it keeps the first value (a kernel
never costs less than its smallest measured launch) and is 0 at 0; above the last point it grows
in proportion to the count (large GEMMs and copies are throughput-bound: linear in size).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np


def _merge_duplicates(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique ``x`` with the mean ``y`` of repeated measurements of the same ``x``."""
    ux, inverse = np.unique(x, return_inverse=True)
    return ux, np.bincount(inverse, weights=y) / np.bincount(inverse)


def isotonic_envelope(y: np.ndarray) -> np.ndarray:
    """The L∞-optimal non-decreasing fit of positive ``y`` in log space (see module doc)."""
    log_y = np.log(y)
    upper = np.maximum.accumulate(log_y)
    lower = np.minimum.accumulate(log_y[::-1])[::-1]
    return np.exp(0.5 * (upper + lower))


@dataclass(frozen=True)
class MonotoneCurve:
    """A non-decreasing piecewise-linear curve ``f(x)``, ``f(0) = 0``; ``x`` a count."""

    xs: np.ndarray
    ys: np.ndarray
    # the same points as Python floats: a scalar lookup is a bisect, not a numpy call (the
    # simulator prices every step with a few dozen lookups)
    _x: list[float] = field(init=False, repr=False, compare=False)
    _y: list[float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_x", [float(v) for v in self.xs])
        object.__setattr__(self, "_y", [float(v) for v in self.ys])

    @classmethod
    def fit(cls, x: np.ndarray, y: np.ndarray) -> MonotoneCurve:
        """Fit measured ``(x, y)`` pairs (``x > 0``, ``y > 0``; repeats of one ``x`` averaged)."""
        ux, uy = _merge_duplicates(np.asarray(x, dtype=np.float64),
                                   np.asarray(y, dtype=np.float64))
        if ux.size == 0 or ux[0] <= 0 or (uy <= 0).any():
            raise ValueError("a monotone curve needs positive counts and positive times")
        return cls(ux, isotonic_envelope(uy))

    def __call__(self, x: float) -> float:
        """Linear between points, the first value below the first point (as ``np.interp``),
        proportional to ``x`` beyond the last."""
        if x <= 0:
            return 0.0
        xs, ys = self._x, self._y
        if x >= xs[-1]:
            return ys[-1] * (x / xs[-1])
        i = bisect.bisect_right(xs, x)
        if i == 0:
            return ys[0]
        x0, y0 = xs[i - 1], ys[i - 1]
        return y0 + (ys[i] - y0) * (x - x0) / (xs[i] - x0)

    def many(self, x: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`__call__`."""
        x = np.asarray(x, dtype=np.float64)
        out = np.interp(x, self.xs, self.ys)
        above = x > self.xs[-1]
        out[above] = self.ys[-1] * (x[above] / self.xs[-1])
        out[x <= 0] = 0.0
        return out

    def plus(self, other: MonotoneCurve) -> MonotoneCurve:
        """``self + other`` on the union of both grids (monotone, since both are)."""
        grid = np.union1d(self.xs, other.xs)
        return MonotoneCurve(grid, self.many(grid) + other.many(grid))

    def scaled(self, factor: float) -> MonotoneCurve:
        return MonotoneCurve(self.xs, self.ys * factor)

    def geometric_mean(self, other: MonotoneCurve) -> MonotoneCurve:
        """``sqrt(self · other)`` on the union grid: the log-midpoint of two measured curves."""
        grid = np.union1d(self.xs, other.xs)
        return MonotoneCurve(grid, np.sqrt(self.many(grid) * other.many(grid)))
