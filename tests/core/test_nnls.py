import numpy as np
import pytest
from scipy.optimize import nnls as scipy_nnls

from deltaserve.core.nnls import nnls


@pytest.mark.parametrize("seed", range(20))
def test_matches_scipy(seed):
    rng = np.random.default_rng(seed)
    m, n = rng.integers(6, 40), rng.integers(1, 6)
    a = rng.normal(size=(m, n)) * rng.choice([1e-3, 1.0, 1e4], size=n)
    b = rng.normal(size=m)
    ours = nnls(a, b)
    ref, _ = scipy_nnls(a, b)
    assert (ours >= 0).all()
    # both are minimisers of a convex problem: compare the residuals
    assert np.linalg.norm(a @ ours - b) == pytest.approx(np.linalg.norm(a @ ref - b), rel=1e-6)


def test_exact_non_negative_solution_recovered():
    rng = np.random.default_rng(1)
    a = rng.uniform(size=(50, 4)) * [1e6, 1e3, 1.0, 1.0]
    x = np.array([2e-9, 3e-5, 0.0, 0.01])
    np.testing.assert_allclose(nnls(a, a @ x), x, rtol=1e-6, atol=1e-12)
