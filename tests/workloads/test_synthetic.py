import numpy as np
import pytest

from deltaserve.core import InputError
from deltaserve.workloads.synthetic import generate


def test_deterministic_from_seed():
    assert generate("burst-dense", seed=3) == generate("burst-dense", seed=3)
    assert generate("burst-dense", seed=3) != generate("burst-dense", seed=4)


@pytest.mark.parametrize("name,peak,low,peak_s", [("burst-light", 80, 1, 2),
                                                  ("burst-dense", 120, 2, 4)])
def test_burst_traces_have_their_documented_shape(name, peak, low, peak_s):
    t = generate(name, seed=0)
    assert t.duration_s == 60
    rates = np.array(t.rate_curve())
    phase = np.arange(60) % 6
    in_peak = phase < peak_s
    assert rates[in_peak].mean() == pytest.approx(peak, rel=0.1)
    assert rates[~in_peak].mean() == pytest.approx(low, abs=1.5)
    assert len(t) == pytest.approx(10 * (peak * peak_s + low * (6 - peak_s)), rel=0.1)


def test_production_is_multiscale_and_heavy_tailed():
    t = generate("production", seed=0)
    assert t.duration_s == 1200
    rates = np.array(t.rate_curve())
    assert rates.max() > 100  # spikes
    quiet = np.convolve(rates < 1, np.ones(30), "valid") == 30
    assert quiet.any()  # a near-idle half minute
    assert np.percentile(rates, 99) > 5 * np.median(rates)
    prompts = np.array([r.prompt_tokens for r in t.requests])
    assert np.percentile(prompts, 99) > 4 * np.median(prompts)  # heavy tail


def test_unknown_name():
    with pytest.raises(InputError, match="burst-light"):
        generate("bursty")
