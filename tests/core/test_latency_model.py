import math
from dataclasses import replace

import numpy as np
import pytest

from deltaserve.core import (
    Equation,
    ExecMode,
    HostLimits,
    InputError,
    LatencyModel,
    LatencyModelConfig,
    StepShape,
    build_plan,
)
from deltaserve.core.latency_model import fit_from
from deltaserve.core.shape import StepKind

# ζ: inference rows cost more beside training rows (an engine's LoRA over the whole batch)
EAGER_I = dict(alpha=2e-8, beta=2e-4, gamma=2.6e-4, epsilon=1e-6, c=5e-3, zeta=1.2e-4)
GRAPH_I = dict(alpha=2e-8, beta=1.8e-4, gamma=0.0, epsilon=8e-7, c=1e-3, zeta=0.0)
EAGER_II = dict(beta=5e-4, epsilon=2e-6, c=4e-3)
GRAPH_II = dict(beta=3e-4, epsilon=1.5e-6, c=6e-4)
TRUE = {
    (Equation.MIXED, ExecMode.EAGER): EAGER_I,
    (Equation.MIXED, ExecMode.GRAPH): GRAPH_I,
    (Equation.DECODE, ExecMode.EAGER): EAGER_II,
    (Equation.DECODE, ExecMode.GRAPH): GRAPH_II,
}
LIMITS = HostLimits(max_tokens_per_step=2048, max_seqs_per_step=64, max_model_len=2048,
                    max_kv_tokens=100_000)


def true_time(s: StepShape) -> float:
    if s.is_decode_only:
        k = TRUE[(Equation.DECODE, s.mode)]
        return k["beta"] * s.num_decode + k["epsilon"] * s.kv_tokens + k["c"]
    k = TRUE[(Equation.MIXED, s.mode)]
    rows = s.num_prefill_tokens + s.num_decode
    return (k["alpha"] * s.prefill_sq_tokens + k["beta"] * rows + k["gamma"] * s.num_ft_tokens
            + k["epsilon"] * s.kv_tokens + k["c"] + (k["zeta"] * rows if s.ft_lens else 0.0))


def random_shapes(rng, n, mode=ExecMode.EAGER):
    out = []
    for _ in range(n):
        kind = rng.integers(3)
        if kind == 0:
            out.append(StepShape(num_decode=int(rng.integers(1, 64)),
                                 kv_tokens=int(rng.integers(1, 60_000)), mode=mode))
        else:
            pre = tuple(int(x) for x in rng.integers(1, 700, size=rng.integers(1, 5)))
            s = StepShape(pre, num_decode=int(rng.integers(0, 32)),
                          kv_tokens=int(rng.integers(0, 30_000)), mode=mode)
            if kind == 2 and mode is ExecMode.EAGER:
                s = s.with_ft(tuple(int(x) for x in rng.integers(16, 400, size=rng.integers(1, 4))))
            out.append(s)
    return out


def observations(rng, shapes, noise=0.01):
    return [(s, true_time(s) * (1 + noise * rng.standard_normal())) for s in shapes]


@pytest.fixture
def fitted():
    rng = np.random.default_rng(0)
    plan = [p.shape for p in build_plan(LIMITS) for _ in range(3)]
    # a graph-capable host profiles its inference-only probes in both modes
    shapes = plan + [replace(s, mode=ExecMode.GRAPH) for s in plan if not s.ft_lens]
    shapes += random_shapes(rng, 300) + random_shapes(rng, 300, ExecMode.GRAPH)
    return fit_from(observations(rng, shapes))


@pytest.mark.parametrize("key", list(TRUE))
def test_coefficient_recovery_within_a_few_percent(fitted, key):
    got = fitted.coefficients(*key)
    for name, want in TRUE[key].items():
        if want == 0:
            assert got[name] < 1e-6, name
        else:
            # α is a small share of any step, so 1 % noise moves it most (σ ≈ 3 % here)
            assert got[name] == pytest.approx(want, rel=0.08 if name == "alpha" else 0.05), name


def test_prediction_error_and_quality_report(fitted):
    rng = np.random.default_rng(7)
    shapes = random_shapes(rng, 200)
    err = [abs(fitted.predict(s) - true_time(s)) / true_time(s) for s in shapes]
    assert np.mean(err) < 0.01
    q = {(f.equation, f.mode): f for f in fitted.quality()}
    assert set(q) == set(TRUE)
    for f in q.values():
        assert f.mape < 0.02 and f.r2 > 0.99


def test_graph_and_eager_are_separate_fits(fitted):
    s = StepShape(num_decode=16, kv_tokens=4096)
    g = StepShape(num_decode=16, kv_tokens=4096, mode=ExecMode.GRAPH)
    assert fitted.predict(s) == pytest.approx(true_time(s), rel=0.02)
    assert fitted.predict(g) == pytest.approx(true_time(g), rel=0.02)
    assert fitted.predict(g) < 0.7 * fitted.predict(s)


def test_fine_tuning_steps_are_priced_eager(fitted):
    s = StepShape((128,), num_decode=4, mode=ExecMode.GRAPH)
    assert fitted.predict(s.with_ft((64,))) == pytest.approx(true_time(s.with_ft((64,))), rel=0.02)


def test_unfitted_graph_falls_back_to_eager():
    rng = np.random.default_rng(3)
    m = fit_from(observations(rng, random_shapes(rng, 200)))  # eager only
    g = StepShape((100,), mode=ExecMode.GRAPH)
    assert m.predict(g) == m.predict(StepShape((100,)))


def test_uncalibrated_admits_nothing():
    m = LatencyModel()
    assert not m.is_calibrated
    assert m.predict(StepShape((10,))) == math.inf
    assert m.ft_pricer(StepShape((10,))) is None


def test_window_ages_out_old_observations():
    cfg = LatencyModelConfig(window=32, refit_every=1, keep_calibration=False)
    m = LatencyModel(cfg)
    s = StepShape(num_decode=8, kv_tokens=1000)
    rng = np.random.default_rng(0)
    for shape in random_shapes(rng, 400):  # the machine as it was
        m.observe(shape, true_time(shape))
    before = m.predict(s)
    for shape in random_shapes(rng, 400):  # the machine got 2x slower
        m.observe(shape, 2 * true_time(shape))
    assert m.predict(s) == pytest.approx(2 * before, rel=0.05)
    ring = m._online[(Equation.DECODE, ExecMode.EAGER)]
    assert ring.size == 32 and ring.rows.shape[0] == 32  # bounded memory


def test_margin_is_relative_and_covers_the_noise():
    rng = np.random.default_rng(5)
    cfg = LatencyModelConfig(margin_quantile=0.95)
    shapes = random_shapes(rng, 400)
    m = fit_from(observations(rng, shapes, noise=0.05), cfg)
    margin = m.margin(Equation.MIXED, ExecMode.EAGER)
    assert 0.04 < margin < 0.15  # ~1.645 sigma of 5 % noise
    test = [s for s in random_shapes(rng, 400) if not s.is_decode_only]
    covered = np.mean([true_time(s) * (1 + 0.05 * rng.standard_normal()) <= m.predict_upper(s)
                       for s in test])
    assert covered > 0.9
    s = StepShape((200,), num_decode=3)
    assert m.predict_upper(s) == pytest.approx(m.predict(s) * (1 + margin))


# Inference batches a pricer must price like predict_upper: prefill chunks alone, and chunks
# behind a cached prefix (a chunked-prefill continuation, whose Σn² term carries 2·n·p).
PRICER_BASES = [
    StepShape((120, 30), num_decode=5, kv_tokens=900),
    StepShape((64,), kv_tokens=448, prefill_prefix_lens=(448,)),
    StepShape((120, 30), num_decode=5, kv_tokens=1900, prefill_prefix_lens=(0, 1000)),
    StepShape((200, 10, 7), kv_tokens=3000, prefill_prefix_lens=(1500, 1200, 300)),
]


@pytest.mark.parametrize("base", PRICER_BASES)
def test_ft_pricer_matches_predict_upper(fitted, base):
    pricer = fitted.ft_pricer(base)
    for ft in [(16,), (16, 40), (100, 200, 300)]:
        want = fitted.predict_upper(base.with_ft(ft))
        got = pricer.upper_s(sum(n * n for n in ft), sum(ft))
        assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("base", PRICER_BASES)
def test_ft_pricer_base_is_predict_upper_of_the_eager_batch(fitted, base):
    """With no sample added, the pricer is the eager Equation I of the batch itself, prefix
    term included (it once dropped 2·n·p and under-priced chunked-prefill continuations)."""
    assert base.mode is ExecMode.EAGER and not base.is_decode_only
    assert fitted.ft_pricer(base).upper_s(0, 0) == pytest.approx(fitted.predict_upper(base),
                                                                rel=1e-12)


def test_online_error_is_out_of_sample(fitted):
    rng = np.random.default_rng(11)
    for s in random_shapes(rng, 50):
        predicted = fitted.predict(s)
        assert fitted.observe(s, true_time(s)) == pytest.approx(predicted)
    (err,) = [e for e in fitted.online_error() if e.mode is ExecMode.EAGER]
    assert err.num_steps == 50 and err.mape < 0.02
    assert all(e.num_steps <= 50 for e in fitted.online_error(min_seconds=0.02))


def test_json_round_trip(fitted, tmp_path):
    path = tmp_path / "lm.json"
    fitted.save(path)
    loaded = LatencyModel.load(path)
    rng = np.random.default_rng(2)
    for s in random_shapes(rng, 50) + random_shapes(rng, 50, ExecMode.GRAPH):
        assert loaded.predict_upper(s) == fitted.predict_upper(s)
    assert loaded.config == fitted.config
    loaded.fit()  # the observations travelled too: refitting gives the same model
    for s in random_shapes(rng, 20):
        assert loaded.predict(s) == pytest.approx(fitted.predict(s), rel=1e-9)


def test_format_1_files_load_with_zeta_zero_and_refit_it(fitted, tmp_path):
    import json

    path = tmp_path / "lm.json"
    fitted.save(path)
    doc = json.loads(path.read_text())
    doc["format"] = "deltaserve.latency_model/1"
    for entry in doc["keys"]:  # what format 1 wrote: no ζ column, no ζ coefficient
        if entry["equation"] == "mixed":
            entry["coefficients"] = entry["coefficients"] and entry["coefficients"][:5]
            for name in ("anchors", "online"):
                entry[name] = [r[:5] + r[6:] for r in entry[name]]
    path.write_text(json.dumps(doc))
    old = LatencyModel.load(path)
    zeta = fitted.coefficients(Equation.MIXED, ExecMode.EAGER)["zeta"]
    plain, beside = StepShape((200,), num_decode=3, kv_tokens=900), StepShape((200,), 3, 900)
    beside = beside.with_ft((64,))
    assert old.predict(plain) == pytest.approx(fitted.predict(plain), rel=1e-12)
    assert old.predict(beside) == pytest.approx(fitted.predict(beside) - zeta * 203, rel=1e-9)
    old.fit()  # the upgraded observations carry the ζ feature: a refit finds ζ again
    assert old.coefficients(Equation.MIXED, ExecMode.EAGER)["zeta"] == pytest.approx(zeta,
                                                                                     rel=1e-6)


def test_load_rejects_other_files(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{}")
    with pytest.raises(InputError, match="latency-model"):
        LatencyModel.load(p)
    with pytest.raises(InputError, match="cannot read"):
        LatencyModel.load(tmp_path / "missing.json")


@pytest.mark.parametrize("seconds", [0.0, -1.0, math.nan, math.inf])
def test_rejects_bad_times(seconds):
    with pytest.raises(InputError, match="seconds"):
        LatencyModel().observe(StepShape((3,)), seconds)


@pytest.mark.parametrize("kwargs,field", [
    ({"window": 2}, "window"), ({"margin_quantile": 0}, "margin_quantile"),
    ({"margin_floor": 0.5, "margin_cap": 0.1}, "margin_cap"), ({"weighting": "l1"}, "weighting"),
])
def test_config_validation(kwargs, field):
    with pytest.raises(InputError) as e:
        LatencyModelConfig(**kwargs)
    assert e.value.field == field


def _slowed_decode_steps(model, rng, factor, n):
    for s in random_shapes(rng, n):
        if s.is_decode_only:
            model.observe(s, factor * true_time(s))


def test_level_learns_a_slowdown_of_one_kind_only(fitted):
    """Decode steps served 1.25x slower than the calibration probes: within tens of steps the
    decode prediction is 1.25x the truth, while the prefill kind keeps its level of 1."""
    rng = np.random.default_rng(13)
    _slowed_decode_steps(fitted, rng, 1.25, 300)  # ~100 decode steps
    assert fitted.level(StepKind.DECODE, ExecMode.EAGER) > 1.05
    assert fitted.level(StepKind.PREFILL, ExecMode.EAGER) == 1.0
    probe = [s for s in random_shapes(rng, 200) if s.is_decode_only]
    ratio = [fitted.predict(s) / true_time(s) for s in probe]
    assert np.mean(ratio) == pytest.approx(1.25, rel=0.03)
    prefill = StepShape((300, 40), num_decode=6, kv_tokens=2000)
    assert fitted.predict(prefill) == pytest.approx(true_time(prefill), rel=0.02)


def test_level_rate_zero_predicts_the_fit_alone():
    """With no level, a prediction is the closed form of the fitted coefficients."""
    rng = np.random.default_rng(17)
    cfg = LatencyModelConfig(level_rate=0.0)
    m = fit_from(observations(rng, random_shapes(rng, 300)), cfg)
    _slowed_decode_steps(m, rng, 1.25, 300)
    assert m.level(StepKind.DECODE, ExecMode.EAGER) == 1.0
    k = m.coefficients(Equation.DECODE, ExecMode.EAGER)
    s = StepShape(num_decode=12, kv_tokens=5000)
    want = k["beta"] * 12 + k["epsilon"] * 5000 + k["c"]
    assert m.predict(s) == pytest.approx(want, rel=1e-9)


def test_ft_pricer_carries_the_mixed_ft_level(fitted):
    """A pricer prices a sample at the level its step will be served at (mixed+ft), so it still
    equals predict_upper once the levels have moved apart."""
    rng = np.random.default_rng(19)
    base = PRICER_BASES[0]
    for s in random_shapes(rng, 300):
        if s.ft_lens and not s.is_decode_only:
            fitted.observe(s, 1.4 * true_time(s))
    assert fitted.level(StepKind.MIXED_FT, ExecMode.EAGER) > 1.1
    want = fitted.predict_upper(base.with_ft((100, 50)))
    assert fitted.ft_pricer(base).upper_s(100 * 100 + 50 * 50, 150) == pytest.approx(want,
                                                                                     rel=1e-12)


def test_a_step_after_a_yield_has_its_own_level_starting_from_its_kinds():
    rng = np.random.default_rng(23)
    m = fit_from(observations(rng, random_shapes(rng, 300)))
    _slowed_decode_steps(m, rng, 1.2, 300)
    s = StepShape(num_decode=12, kv_tokens=5000)
    after = replace(s, after_yield=True)
    assert m.predict(after) == m.predict(s)  # none seen after a yield: the kind's level
    for _ in range(80):
        m.observe(after, 1.5 * true_time(s))
    assert m.predict(after) == pytest.approx(1.5 * true_time(s), rel=0.03)
    assert m.predict(s) == pytest.approx(1.2 * true_time(s), rel=0.05)
    assert m.level(StepKind.DECODE, ExecMode.EAGER, True) > m.level(StepKind.DECODE,
                                                                     ExecMode.EAGER)


def test_a_late_mixed_ft_step_prices_the_next_ones_at_its_lateness():
    """The tail margin: once a mixed+ft step ran 30 % over its prediction, every mixed+ft shape
    is priced ≥ 1.3× its point estimate (the pricer too), inference-only shapes keep the fit's
    margin, and the lateness ages out after ``tail_window`` on-time mixed+ft steps."""
    rng = np.random.default_rng(23)
    cfg = LatencyModelConfig(level_rate=0.0, tail_window=16)
    m = fit_from(observations(rng, [p.shape for p in build_plan(LIMITS) for _ in range(3)],
                              noise=0.0), cfg)
    base = StepShape((120,), num_decode=6, kv_tokens=900)
    mixed = base.with_ft((64, 64))
    fit_margin = m.margin(Equation.MIXED, ExecMode.EAGER)
    assert fit_margin < 0.05
    assert m.predict_upper(mixed) == pytest.approx(m.predict(mixed) * (1 + fit_margin))
    m.observe(mixed, 1.3 * m.predict(mixed))
    assert m.predict_upper(mixed) == pytest.approx(m.predict(mixed) * 1.3, rel=1e-6)
    assert m.ft_pricer(base).upper_s(2 * 64 * 64, 128) == pytest.approx(
        m.predict_upper(mixed), rel=1e-12)
    assert m.predict_upper(base) == pytest.approx(m.predict(base) * (1 + fit_margin))
    assert m.predict_upper(StepShape(ft_lens=(64,))) < 1.1 * m.predict(StepShape(ft_lens=(64,)))
    for _ in range(16):
        m.observe(mixed, m.predict(mixed))
    assert m.predict_upper(mixed) < 1.1 * m.predict(mixed)


def test_tail_settings_are_checked():
    with pytest.raises(InputError, match="tail_quantile"):
        LatencyModelConfig(tail_quantile=0.0)
    with pytest.raises(InputError, match="tail_window"):
        LatencyModelConfig(tail_window=0)
