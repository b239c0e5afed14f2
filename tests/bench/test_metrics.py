import pytest

from deltaserve.bench import metrics as M
from deltaserve.bench.replay import RequestRecord
from deltaserve.core import SLOConfig, StepShape
from deltaserve.core.contract import StepRecord

SLO = SLOConfig(ttft_s=1.0, tpot_s=0.2)


def rec(i, scheduled, times, finished=True):
    return RequestRecord(i, scheduled, 10, len(times), tuple(times), finished)


RECORDS = [
    rec(0, 0.0, [0.5, 0.6, 0.7]),  # meets: ttft .5, max gap .1
    rec(1, 1.0, [2.5, 2.6]),  # ttft 1.5 > 1.0
    rec(2, 2.0, [2.2, 2.3, 2.8]),  # max gap .5 > .2
    rec(3, 3.0, [3.9]),  # meets: one token, no gap
    rec(4, 4.0, [4.1], finished=False),  # never finished: misses
]


def test_slo_per_request():
    assert [M.meets_slo(r, SLO) for r in RECORDS] == [True, False, False, True, False]
    assert M.attainment(RECORDS, SLO) == pytest.approx(2 / 5)


def test_compute_known_answers():
    m = M.compute(RECORDS, SLO, wall_s=10.0, ft_tokens=500, ft_samples=5,
                  latency_model_mape=0.04, harvest=0.9)
    assert m.ft_tokens_per_s == 50 and m.ft_samples_per_s == 0.5
    assert m.completed_requests == 4
    ttfts = [0.5, 1.5, 0.2, 0.9, 0.1]
    assert m.ttft_p50_ms == pytest.approx(500)
    assert m.ttft_p99_ms == pytest.approx(1e3 * (0.9 + 0.96 * (1.5 - 0.9)))
    assert sorted(ttfts)[2] == 0.5
    assert m.tpot_p99_ms == pytest.approx(1e3 * (0.1 + 0.97 * (0.5 - 0.1)))
    assert m.mean_e2e_s == pytest.approx((0.7 + 1.6 + 0.8 + 0.9) / 4)
    assert set(m.as_json()) == {
        "ft_tokens_per_s", "ft_samples_per_s", "slo_attainment", "ttft_p50_ms", "ttft_p99_ms",
        "tpot_p99_ms", "mean_e2e_s", "completed_requests", "latency_model_mape",
        "harvest_ratio"}


def test_idle_fraction_and_harvest():
    steps = [StepRecord(1.0, StepShape((5,)), 0.5, 0, False),
             StepRecord(2.0, StepShape(num_decode=2), 1.5, 0, False)]
    assert M.idle_fraction(steps, 8.0) == pytest.approx(0.75)
    # 30 tok/s harvested out of 100 tok/s × 75 % idle
    assert M.harvest_ratio(30.0, 100.0, 0.75) == pytest.approx(0.4)
    assert M.harvest_ratio(30.0, 100.0, 0.0) is None


def test_empty_run():
    m = M.compute([], SLO, 1.0, 0, 0, None)
    assert m.slo_attainment == 1.0 and m.ttft_p50_ms is None and m.completed_requests == 0
