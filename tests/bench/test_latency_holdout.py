"""The latency model's held-out steps: predicted, never learned from."""

import random

import numpy as np
import pytest

from deltaserve.bench.latency_holdout import (
    HoldoutLatencyModel,
    KindError,
    StepKind,
    errors_by_kind,
    errors_by_mode,
    errors_by_yield,
    kind_of,
    pooled_kind_errors,
    step_predictions,
)
from deltaserve.core import StepShape
from deltaserve.core.contract import StepRecord
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


def test_every_steps_prediction_is_kept_by_the_shape_and_seconds_the_host_logs(saved):
    model = HoldoutLatencyModel.load(saved)
    model.every = 3
    reference = HoldoutLatencyModel.load(saved)
    reference.every = 3
    want = {}
    for shape, seconds in served_steps(30):
        want[shape, seconds] = reference.observe(shape, seconds)  # held out or online alike
        model.observe(shape, seconds)
    got = step_predictions(model)
    assert got.keys() == want.keys() and len(got) == 30
    assert all(got[k] == pytest.approx(v) for k, v in want.items())
    assert step_predictions(LatencyModel.load(saved)) == {}  # a model that keeps none


def test_the_error_splits_by_whether_a_yield_preceded_the_step():
    dec, pre = StepShape(num_decode=4, kv_tokens=64), StepShape((32,), kv_tokens=0)
    steps = [StepRecord(1.0, dec, 0.10, 0, False), StepRecord(2.0, dec, 0.13, 0, False, 0.2),
             StepRecord(3.0, dec, 0.15, 0, False, 0.1), StepRecord(4.0, pre, 0.30, 0, False),
             StepRecord(5.0, pre, 0.01, 0, False),  # shorter than the filter
             StepRecord(6.0, dec, 0.12, 0, False)]  # never predicted: left out
    predicted = {(dec, 0.10): 0.10, (dec, 0.13): 0.10, (dec, 0.15): 0.10, (pre, 0.30): 0.25,
                 (pre, 0.01): 0.01}
    got = {(e.kind, e.mode): e for e in errors_by_yield(steps, predicted, 0.02)}
    assert set(got) == {("decode no yield", "eager"), ("decode after a yield", "eager"),
                        ("prefill no yield", "eager")}
    after = got["decode after a yield", "eager"]
    # actual ÷ predicted 1.3 and 1.5: bias +40 %; |error| ÷ actual 0.03/0.13 and 0.05/0.15
    assert after.steps == 2 and after.bias == pytest.approx(0.4)
    assert after.mape == pytest.approx((0.03 / 0.13 + 0.05 / 0.15) / 2)
    assert got["decode no yield", "eager"].bias == pytest.approx(0.0)
    assert got["prefill no yield", "eager"].bias == pytest.approx(0.2)


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


def kinded_steps(n=160, seed=1):
    """Steps of every kind, each kind off the calibration by its own factor."""
    rng = random.Random(seed)
    slower = {StepKind.DECODE: 1.0, StepKind.PREFILL: 1.1, StepKind.MIXED_FT: 1.4,
              StepKind.FT_ONLY: 0.8}
    out = []
    for _ in range(n):
        pick = rng.randrange(4)
        if pick == 0:
            s = StepShape(num_decode=rng.randint(1, 16), kv_tokens=rng.randint(16, 2000))
        elif pick == 1:
            s = StepShape((rng.randint(8, 200),), num_decode=rng.randint(0, 8))
        elif pick == 2:
            s = StepShape((rng.randint(8, 200),), num_decode=rng.randint(0, 8),
                          ft_lens=(rng.randint(8, 120),))
        else:
            s = StepShape(ft_lens=(rng.randint(8, 120), rng.randint(8, 120)))
        out.append((s, slower[kind_of(s)] * exact(s) * rng.uniform(0.97, 1.03)))
    return out


def test_the_kinds_split_the_step_shapes():
    assert kind_of(StepShape(num_decode=3, kv_tokens=9)) is StepKind.DECODE
    assert kind_of(StepShape((5,), num_decode=3)) is StepKind.PREFILL
    assert kind_of(StepShape(num_decode=3, ft_lens=(4,))) is StepKind.MIXED_FT
    assert kind_of(StepShape(ft_lens=(4,))) is StepKind.FT_ONLY


def test_online_error_by_kind_is_each_kinds_own_mape_and_bias(saved):
    """Against a brute force: a plain model predicting each learned step before learning it,
    grouped by kind by hand. Held-out steps stay out of the split, as out of the online MAPE."""
    model = HoldoutLatencyModel.load(saved)
    model.every = 5
    reference = LatencyModel.load(saved)
    rows: dict[str, list[tuple[float, float]]] = {}
    for i, (shape, seconds) in enumerate(kinded_steps(), start=1):
        model.observe(shape, seconds)
        if i % 5:
            rows.setdefault(kind_of(shape).value, []).append(
                (reference.observe(shape, seconds), seconds))
    split = {e.kind: e for e in errors_by_kind(model, 0.0)}
    assert set(split) == {k.value for k in StepKind} == set(rows)
    for kind, got in split.items():
        pred, y = np.array(rows[kind]).T
        assert got.mode == ExecMode.EAGER.value and got.steps == len(y)
        assert got.mape == pytest.approx(float(np.mean(np.abs(pred - y) / y)))
        assert got.bias == pytest.approx(float(np.mean(y / pred)) - 1)
    # the calibration is exact, so each kind's bias shows its own slowdown until the refit
    # catches up: the ones run slower than calibrated lean positive, the faster one negative
    assert split["mixed+ft"].bias > split["decode"].bias > split["ft-only"].bias
    assert sum(e.steps for e in split.values()) == model.online_error()[0].num_steps
    assert errors_by_kind(LatencyModel.load(saved), 0.0) == () and errors_by_kind(None, 0) == ()


def test_pooled_kind_errors_equal_the_error_over_every_repeats_steps():
    a = (KindError("decode", "eager", 2, 0.1, 0.05), KindError("prefill", "eager", 1, 0.3, -0.2))
    b = (KindError("decode", "eager", 6, 0.2, -0.05),)
    pooled = {e.kind: e for e in pooled_kind_errors([a, b])}
    assert pooled["decode"].steps == 8
    assert pooled["decode"].mape == pytest.approx((2 * 0.1 + 6 * 0.2) / 8)
    assert pooled["decode"].bias == pytest.approx((2 * 0.05 - 6 * 0.05) / 8)
    assert pooled["prefill"] == a[1]
