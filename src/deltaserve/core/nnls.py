"""Non-negative least squares (Lawson & Hanson, 1974), small and dependency-free.

The latency model has at most six coefficients, so the active-set loop runs on the normal
equations: ``AᵀA`` (n × n) and ``Aᵀb`` are formed once, and every subproblem is an n × n solve
instead of a least-squares pass over all m observations (Bro & De Jong, 1997). The model refits
every few steps on hundreds of rows, so this is what online refitting costs. Columns are scaled
to unit max so features of very different magnitude (``Σn²`` in the millions, the constant in
ones) solve stably.
"""

from __future__ import annotations

import numpy as np


def nnls(a: np.ndarray, b: np.ndarray, *, max_iter: int | None = None) -> np.ndarray:
    """Return ``x >= 0`` minimising ``||a @ x - b||₂``."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 1 or a.shape[0] != b.shape[0]:
        raise ValueError(f"nnls: incompatible shapes a={a.shape} b={b.shape}")
    n = a.shape[1]
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    gram, atb = a.T @ a, a.T @ b
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(1.0, np.abs(a).max()) * max(a.shape)
    for _ in range(max_iter or 3 * n + 10):
        w = atb - gram @ x  # Aᵀ(b − Ax), the negative gradient
        candidates = ~passive & (w > tol)
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, w, -np.inf))] = True
        while True:
            z = np.zeros(n)
            p = np.flatnonzero(passive)
            # the least-squares solution on the passive set (min-norm where rank-deficient)
            z[p] = np.linalg.lstsq(gram[np.ix_(p, p)], atb[p], rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            blocking = passive & (z <= 0)
            step = np.min(x[blocking] / (x[blocking] - z[blocking]))
            x = x + step * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x / scale
