"""MonotoneCurve against brute-force references on small hand-made data."""

from __future__ import annotations

import numpy as np
import pytest

from deltaserve.hosts.sim.curves import MonotoneCurve


def dip_bound(y: np.ndarray) -> np.ndarray:
    """The least worst-case relative error any monotone curve has at each point, by brute
    force: sqrt(max of earlier points / min of later points) - 1 (0 where locally monotone)."""
    out = np.zeros_like(y)
    for i in range(len(y)):
        upper, lower = y[: i + 1].max(), y[i:].min()
        out[i] = np.sqrt(upper / lower) - 1.0
    return out


def test_monotone_data_is_reproduced_exactly():
    x = np.array([1, 2, 4, 8, 16.0])
    y = np.array([0.1, 0.12, 0.2, 0.35, 0.7])
    curve = MonotoneCurve.fit(x, y)
    assert np.allclose(curve.many(x), y)
    # linear between points
    assert curve(3) == pytest.approx(0.16)


def test_a_dip_costs_exactly_the_minimax_error_and_stays_monotone():
    x = np.arange(1, 9, dtype=float)
    y = np.array([1.0, 2.0, 3.0, 2.4, 3.5, 4.0, 3.9, 5.0])
    curve = MonotoneCurve.fit(x, y)
    rel = np.abs(curve.many(x) / y - 1.0)
    bound = dip_bound(y)
    # never worse than the bound at any point, and the worst equals the least possible worst
    assert (rel <= bound + 1e-12).all()
    assert rel.max() == pytest.approx(bound.max())
    assert rel[[0, 1, 4, 7]] == pytest.approx([0, 0, 0, 0], abs=1e-12)
    dense = np.linspace(0, 12, 2000)
    assert (np.diff(curve.many(dense)) >= -1e-12).all()


def test_duplicates_are_averaged_and_edges_follow_the_documented_rules():
    curve = MonotoneCurve.fit(np.array([2.0, 2.0, 4.0]), np.array([1.0, 3.0, 4.0]))
    assert curve(2) == pytest.approx(2.0)
    assert curve(0) == 0.0
    assert curve(1) == pytest.approx(2.0)       # below the first point: the first value
    assert curve(8) == pytest.approx(8.0)       # above the last: proportional to the count
    assert curve.many(np.array([0.0, 1.0, 8.0])).tolist() == pytest.approx([0.0, 2.0, 8.0])


def test_sums_are_exact_and_geometric_means_hold_on_the_grid():
    a = MonotoneCurve.fit(np.array([1.0, 4.0]), np.array([1.0, 4.0]))
    b = MonotoneCurve.fit(np.array([2.0, 4.0]), np.array([4.0, 16.0]))
    x = np.array([1.0, 2.0, 3.0, 4.0, 9.0])
    assert np.allclose(a.plus(b).many(x), a.many(x) + b.many(x))
    grid = np.array([1.0, 2.0, 4.0])  # the union of both grids: linear in between
    assert np.allclose(a.geometric_mean(b).many(grid), np.sqrt(a.many(grid) * b.many(grid)))


def test_non_positive_input_is_refused():
    with pytest.raises(ValueError):
        MonotoneCurve.fit(np.array([0.0, 1.0]), np.array([1.0, 2.0]))
