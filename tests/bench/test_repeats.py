"""Repeats: one system's runs as medians with their range, and verdicts that say when a margin
is within the range the repeats showed."""

import pytest

from deltaserve.bench.latency_holdout import ModeError
from deltaserve.bench.outcome import Commit, HardwareShare
from deltaserve.bench.repeats import pooled_errors, summarize
from deltaserve.bench.score import binding, comparisons, overlaps, score_run
from deltaserve.core import InputError
from tests.bench.test_score import LATE, OK, PILOT, SLO, SPECS, WINDOWED, run

HALF = OK[:5] + LATE[5:]  # 50 % attainment


def scored(name, records, tokens, latency=()):
    return score_run(run(SPECS[name], records, [Commit(105.0, tokens, 2, tokens)],
                         latency=latency), SLO, WINDOWED)


def test_one_run_is_its_own_summary():
    s = scored("deltaserve", OK, 600)
    assert summarize([s]) is s
    assert s.as_json()["repeats"] == 1 and "range" not in s.as_json()
    assert s.spread("ft_tokens_per_s") is None


def test_medians_and_ranges_of_three_repeats():
    # 600, 1200 and 240 tokens in the 12 s window: 50, 100 and 20 tokens/s
    runs = [scored("deltaserve", OK, 600), scored("deltaserve", LATE, 1200),
            scored("deltaserve", HALF, 240)]
    s = summarize(runs)
    assert s.metrics.ft_tokens_per_s == 50.0 and s.metrics.ft_tokens_in_window == 600
    assert s.metrics.slo_attainment == 0.5  # of 1.0, 0.0, 0.5
    assert s.spread("ft_tokens_per_s") == (20.0, 100.0)
    assert s.spread("slo_attainment") == (0.0, 1.0)
    # the harvest of the median tokens is the median of the repeats' harvests (one charge)
    assert s.harvest.ratio == pytest.approx(sorted(r.harvest.ratio for r in runs)[1])
    doc = s.as_json()
    assert doc["repeats"] == 3 and doc["range"]["ft_tokens_per_s"] == [20.0, 100.0]
    assert [r["ft_tokens_per_s"] for r in doc["runs"]] == [50.0, 100.0, 20.0]


def test_an_even_count_reports_a_measured_value():
    s = summarize([scored("deltaserve", OK, 600), scored("deltaserve", OK, 1200)])
    assert s.metrics.ft_tokens_per_s == 50.0  # the lower middle, not 75 (no run had 75)


def test_latency_error_pools_every_repeats_steps():
    a = (ModeError("eager", 0.10, 30, 0.2, 3),)
    b = (ModeError("eager", 0.02, 10, None, 0), ModeError("graph", 0.05, 5, 0.1, 1))
    pooled = {e.mode: e for e in pooled_errors([a, b])}
    assert pooled["eager"].online_mape == pytest.approx((0.10 * 30 + 0.02 * 10) / 40)
    assert pooled["eager"].online_steps == 40
    assert pooled["eager"].heldout_mape == pytest.approx(0.2)
    assert pooled["eager"].heldout_steps == 3
    assert pooled["graph"] == b[1]


def test_only_one_systems_runs_are_summarized():
    with pytest.raises(InputError):
        summarize([])
    with pytest.raises(InputError):
        summarize([scored("deltaserve", OK, 600), scored("greedy", OK, 600)])
    other_share = score_run(run(SPECS["deltaserve"], OK, share=HardwareShare(2, 1, 1)), SLO,
                            WINDOWED)
    with pytest.raises(InputError):
        summarize([scored("deltaserve", OK, 600), other_share])


def test_overlapping_ranges():
    assert overlaps((1.0, 2.0), (2.0, 3.0)) is True
    assert overlaps((1.0, 2.0), (2.5, 3.0)) is False
    assert overlaps(None, (1.0, 2.0)) is None


def test_a_pair_margin_within_the_range_says_so():
    pilot = summarize([score_run(PILOT, SLO, WINDOWED)] * 3)
    ds = summarize([scored("deltaserve", OK, t) for t in (600, 660, 720)])
    apart = summarize([scored("llmstation", OK, t) for t in (120, 180, 240)])
    close = summarize([scored("llmstation", OK, t) for t in (540, 600, 690)])
    (c,) = comparisons({"inference-only": pilot, "deltaserve": ds, "llmstation": apart})
    assert c.within_range is False and c.ft_ratio == pytest.approx(660 / 180)
    (c,) = comparisons({"inference-only": pilot, "deltaserve": ds, "llmstation": close})
    assert c.within_range is True
    (c,) = comparisons({"deltaserve": scored("deltaserve", OK, 600),
                        "llmstation": scored("llmstation", OK, 600)})
    assert c.within_range is None


def test_the_verdict_says_when_repeats_fall_on_both_sides_of_the_mark():
    pilot = summarize([score_run(PILOT, SLO, WINDOWED)] * 3)
    ds = summarize([scored("deltaserve", r, 600) for r in (OK, OK, HALF)])
    greedy = summarize([scored("greedy", r, 600) for r in (LATE, LATE, LATE)])
    b = binding({"inference-only": pilot, "deltaserve": ds, "greedy": greedy})
    assert b.binds is True
    assert "deltaserve 100.0% (range 50.0%–100.0%)" in b.verdict
    assert "within the repeats' range: deltaserve met it in some repeats" in b.verdict
    steady = summarize([scored("deltaserve", OK, 600)] * 3)
    b = binding({"inference-only": pilot, "deltaserve": steady, "greedy": greedy})
    assert b.binds is True and "within the repeats' range" not in b.verdict
