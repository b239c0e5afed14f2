"""The SLO derived from the pilot, and what the bench says about it."""

from types import SimpleNamespace

import pytest

from deltaserve.bench import run as bench_run
from deltaserve.bench.config import BenchConfig
from deltaserve.bench.slo import derive_slo
from deltaserve.core import InputError, SLOConfig


def test_scale_times_the_pilots_p99s():
    c = derive_slo(400.0, 120.0, 1.5)
    assert (c.ttft_ms, c.tpot_ms) == (600.0, 180.0)
    assert c.config == SLOConfig(0.6, 0.18)
    assert c.ttft_from == c.tpot_from == "pilot"
    assert c.describe() == ("TTFT 600 ms (1.5 × the pilot's p99 400 ms), "
                            "TPOT 180 ms (1.5 × the pilot's p99 120 ms) per request")


def test_a_flag_overrides_its_side_only():
    c = derive_slo(400.0, 120.0, 2.0, tpot_override_ms=100.0)
    assert (c.ttft_ms, c.tpot_ms) == (800.0, 100.0)
    assert (c.ttft_from, c.tpot_from) == ("pilot", "flag")
    assert "TPOT 100 ms (--tpot-slo-ms)" in c.describe()
    both = derive_slo(None, None, 2.0, 3000.0, 400.0)  # nothing to derive: both given
    assert (both.ttft_ms, both.tpot_ms) == (3000.0, 400.0)


@pytest.mark.parametrize("ttft,tpot,field", [(None, 100.0, "ttft_slo_ms"),
                                             (300.0, 0.0, "tpot_slo_ms")])
def test_no_pilot_latency_and_no_flag_is_an_error(ttft, tpot, field):
    with pytest.raises(InputError) as e:
        derive_slo(ttft, tpot, 1.5)
    assert e.value.field == field


def test_pilot_repeats_take_the_median_of_each_sides_p99(monkeypatch):
    # one pilot's worst gap swung 2429 against 1171 and 1177 ms on one SGLang command: the
    # median of three keeps the SLO off the outlier, side by side
    p99s = {"a": (900.0, 2429.0), "b": (850.0, 1171.0), "c": (1000.0, 1177.0)}
    monkeypatch.setattr(bench_run.M, "p99_latencies_ms", lambda records: p99s[records])
    pilots = [SimpleNamespace(result=SimpleNamespace(records=k)) for k in p99s]
    cfg = BenchConfig(slo_scale=1.5, pilot_repeats=3, progress=False)
    slo = bench_run._slos(cfg, pilots)[1.5]
    assert (slo.ttft_ms, slo.tpot_ms) == (1.5 * 900.0, 1.5 * 1177.0)
    assert slo.pilots == 3 and "1.5 × the median of 3 pilots' p99s 1177 ms" in slo.describe()
    one = bench_run._slos(cfg, pilots[:1])[1.5]
    assert (one.tpot_ms, one.pilots) == (1.5 * 2429.0, 1)


@pytest.mark.parametrize("value", [0, -1, 1.5])
def test_pilot_repeats_must_be_a_positive_integer(value):
    with pytest.raises(InputError) as e:
        BenchConfig(pilot_repeats=value)
    assert e.value.field == "pilot_repeats"
