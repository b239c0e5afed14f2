"""The SLO derived from the pilot, and what the bench says about it."""

import pytest

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
