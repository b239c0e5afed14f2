"""The latency model's held-out steps: predicted, never learned from."""

import random

import numpy as np
import pytest

from deltaserve.bench.latency_holdout import HoldoutLatencyModel, errors_by_mode
from deltaserve.core import StepShape
from deltaserve.core.latency_model import LatencyModel, LatencyModelConfig, fit_from
from deltaserve.core.shape import ExecMode
from tests.core.test_admission import SHAPES, exact

CONFIG = LatencyModelConfig(refit_every=2, margin_floor=0.0)


def served_steps(n=120, seed=0):
    """Steps the calibrated model did not see, 30 % slower than calibration (so the online
    refit moves the model: learning from a step or not changes later predictions)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < 0.5:
            s = StepShape((rng.randint(8, 200),), num_decode=rng.randint(0, 8),
                          kv_tokens=rng.randint(0, 800))
        else:
            s = StepShape(num_decode=rng.randint(1, 16), kv_tokens=rng.randint(16, 2000))
        out.append((s, 1.3 * exact(s) * rng.uniform(0.95, 1.05)))
    return out


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "lm.json"
    fit_from([(s, exact(s)) for s in SHAPES], CONFIG).save(path)
    return path


def test_every_kth_step_is_predicted_by_a_model_that_never_learns_from_it(saved):
    k = 4
    model = HoldoutLatencyModel.load(saved)
    model.every = k
    reference = LatencyModel.load(saved)  # learns from every step but the held-out ones
    held = []
    for i, (shape, seconds) in enumerate(served_steps(), start=1):
        got = model.observe(shape, seconds)
        if i % k == 0:
            want = reference.predict(shape)
            assert got == pytest.approx(want)
            held.append((want, seconds))
        else:
            assert got == pytest.approx(reference.observe(shape, seconds))
    for q in reference.quality():  # the same fits: nothing held out reached them
        assert model.coefficients(q.equation, q.mode) == pytest.approx(
            reference.coefficients(q.equation, q.mode))
    errs = model.heldout_error()
    assert sum(e.num_steps for e in errs) == len(held) == 30
    pred, y = np.array(held).T
    pooled = sum(e.mape * e.num_steps for e in errs) / len(held)
    assert pooled == pytest.approx(float(np.mean(np.abs(pred - y) / y)))
    # the online error is over the learned steps only: the reference's own
    assert [(e.mode, e.num_steps, e.mape) for e in model.online_error()] == [
        (e.mode, e.num_steps, pytest.approx(e.mape)) for e in reference.online_error()]


def test_errors_by_mode_pairs_online_and_held_out_and_filters_short_steps(saved):
    model = HoldoutLatencyModel.load(saved)
    model.every = 3
    for shape, seconds in served_steps():
        model.observe(shape, seconds)
    (eager,) = errors_by_mode(model, 0.0)
    assert eager.mode == ExecMode.EAGER.value
    on, = model.online_error()
    ho, = model.heldout_error()
    assert (eager.online_mape, eager.online_steps) == (on.mape, on.num_steps)
    assert (eager.heldout_mape, eager.heldout_steps) == (ho.mape, ho.num_steps)
    assert ho.num_steps == 40
    floor = float(np.median([s for _, s in served_steps()]))
    (long_only,) = errors_by_mode(model, floor)
    assert long_only.online_steps + long_only.heldout_steps < 120
    assert errors_by_mode(model, 1e9) == () and errors_by_mode(None, 0.0) == ()


def test_nothing_is_held_out_by_default(saved):
    model = HoldoutLatencyModel.load(saved)
    for shape, seconds in served_steps(20):
        model.observe(shape, seconds)
    assert model.heldout_error() == () and model.online_error()[0].num_steps == 20
