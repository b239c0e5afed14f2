import numpy as np
import pytest

from deltaserve.core import InputError
from deltaserve.workloads.synthetic import generate
from deltaserve.workloads.trace import Trace, TraceRequest, from_arrivals


def small() -> Trace:
    return from_arrivals("t", [0.1, 0.5, 1.2, 2.9, 3.0], [10, 20, 30, 40, 50], [1, 2, 3, 4, 5],
                         4.0, "test")


def test_rates_and_window():
    t = small()
    assert t.rate_curve() == [2, 1, 1, 1]
    assert t.peak_rate() == 2 and t.mean_rate == pytest.approx(5 / 4)
    w = t.window(1.0, 2.0)
    assert [r.arrival_s for r in w.requests] == pytest.approx([0.2, 1.9])
    assert w.duration_s == 2.0 and [r.prompt_tokens for r in w.requests] == [30, 40]


def test_scale_lengths_clips_to_context():
    t = small().scale_lengths(10, max_prompt=250, max_output=30, max_total=260)
    assert [r.prompt_tokens for r in t.requests] == [100, 200, 250, 250, 250]
    assert all(r.prompt_tokens + r.output_tokens <= 260 for r in t.requests)
    assert [r.output_tokens for r in t.requests][:2] == [10, 20]


@pytest.mark.parametrize("factor", [0.25, 0.5, 2.0, 3.5])
def test_rate_scaling_keeps_the_burst_structure(factor):
    base = generate("burst-light", seed=1)
    scaled = base.scale_rate(factor, seed=2)
    a, b = np.array(base.rate_curve()), np.array(scaled.rate_curve())
    assert len(scaled) == pytest.approx(factor * len(base), rel=0.1)
    assert scaled.duration_s == base.duration_s
    # peaks stay where they were, at factor × the height
    assert np.corrcoef(a, b)[0, 1] > 0.9
    peaks = a > a.mean()
    assert b[peaks].mean() / a[peaks].mean() == pytest.approx(factor, rel=0.15)


def test_validation():
    with pytest.raises(InputError):
        Trace("x", (TraceRequest(0, 0, 1),), 1.0)
    with pytest.raises(InputError):
        Trace("x", (TraceRequest(1, 1, 1), TraceRequest(0, 1, 1)), 2.0)
    with pytest.raises(InputError):
        small().scale_rate(0)
    with pytest.raises(InputError):
        small().window(-1, 2)
