import pytest

from deltaserve.core import HostLimits, StepShape, build_plan
from deltaserve.core.latency_model import fit_from
from deltaserve.workloads.scaling import auto_scale, capacity_rps
from deltaserve.workloads.synthetic import generate

LIMITS = HostLimits(256, 16, 1024, 32_768)


def model(per_token):
    def t(s: StepShape) -> float:
        if s.is_decode_only:
            return 0.02 + 0.002 * s.num_decode
        return 0.02 + per_token * s.num_tokens
    return fit_from([(p.shape, t(p.shape)) for p in build_plan(LIMITS)])


def test_capacity_matches_a_hand_computation():
    m = model(1e-3)
    # B=16 requests of 64+8 tokens: 1024 prompt tokens in 4 full steps of 256 (0.276 s each),
    # then 7 decode steps at batch 16 (0.052 s each): 16 / (1.104 + 0.364) req/s
    assert capacity_rps(m, LIMITS, 64, 8) == pytest.approx(16 / (4 * 0.276 + 7 * 0.052), rel=0.02)


def test_auto_scale_sets_the_peak_and_keeps_the_shape():
    trace = generate("burst-light", seed=0).scale_lengths(0.125)
    slow, fast = model(2e-3), model(5e-4)
    a, fa, ca = auto_scale(trace, slow, LIMITS, peak_fraction=0.8)
    b, fb, cb = auto_scale(trace, fast, LIMITS, peak_fraction=0.8)
    assert cb > ca and fb > fa
    # the expected peak is set exactly; thinning keeps the mean rate in proportion
    assert fa * trace.peak_rate() == pytest.approx(0.8 * ca)
    expected = fa * len(trace)  # binomial thinning: within 4 standard deviations
    assert abs(len(a) - expected) < 4 * (expected * (1 - fa)) ** 0.5
    assert len(b) > len(a)
