"""A host's request counters against hand-computed TTFT and longest inter-token gaps."""

from deltaserve.core.request_stats import RequestCounters, max_tpot_s, ttft_s
from deltaserve.core.requests import RequestOutput
from deltaserve.core.slo import SLOConfig


def out(arrival, times, reason="length") -> RequestOutput:
    return RequestOutput("r", (1,), tuple(range(len(times))), None, True, reason, arrival,
                         times[0] if times else None, tuple(times))


def test_misses_by_kind_from_token_times():
    c = RequestCounters(SLOConfig(ttft_s=1.0, tpot_s=0.5))
    ok = out(10.0, [10.5, 10.9, 11.3])  # ttft 0.5, gaps 0.4 0.4
    late = out(10.0, [11.5, 11.6])  # ttft 1.5
    gappy = out(10.0, [10.2, 10.3, 11.0])  # gap 0.7
    both = out(10.0, [12.0, 13.0])
    assert ttft_s(late) == 1.5 and abs(max_tpot_s(gappy) - 0.7) < 1e-12
    for o in (ok, late, gappy, both, out(10.0, [10.1], reason="abort")):
        c.finished(o)
    c.tokens(3)
    c.tokens(0)
    t = c.totals()
    assert (t.finished, t.ttft_misses, t.tpot_misses, t.slo_missed) == (4, 2, 2, 3)
    assert t.output_tokens == 3


def test_no_objective_no_miss_and_no_token_is_a_ttft_miss():
    c = RequestCounters()
    c.finished(out(0.0, [99.0, 199.0]))
    assert c.totals().slo_missed == 0 and c.totals().finished == 1
    c.set_slo(SLOConfig(1.0, 1.0))
    c.finished(out(0.0, [], reason="stop"))  # finished without a token: no first token ever
    assert c.totals().ttft_misses == 1
