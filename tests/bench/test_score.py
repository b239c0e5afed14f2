"""Scoring a run: the harvest wired from the pilot, commits in the window, pairs, verdicts."""

import pytest

from deltaserve.bench.latency_holdout import ModeError
from deltaserve.bench.outcome import Commit, HardwareShare, SystemRun
from deltaserve.bench.replay import ReplayResult
from deltaserve.bench.score import (
    binding,
    comparisons,
    e2e_vs_inference_only,
    harvest_base,
    pooled_online_mape,
    score_run,
)
from deltaserve.bench.systems import parse_systems
from deltaserve.core import SLOConfig, StepShape
from deltaserve.core.contract import StepRecord
from tests.bench.test_metrics import rec

SPECS = {s.name: s for s in parse_systems("deltaserve,greedy,llmstation,split-pool")}
PILOT_SPEC = parse_systems("deltaserve")[0]
SLO = SLOConfig(ttft_s=1.0, tpot_s=0.2)
OK = [rec(i, float(i), [i + 0.1, i + 0.2]) for i in range(10)]  # all meet
LATE = [rec(i, float(i), [i + 2.0, i + 2.1]) for i in range(10)]  # all miss (TTFT 2 s)


def run(spec, records, commits=(), share=HardwareShare(2, 2, 0), steps=(), start=100.0,
        wall=10.0, latency=()):
    result = ReplayResult(list(records), start, start + wall, wall, list(steps))
    return SystemRun(spec, result, list(commits), tuple(latency), share)


# the pilot: 10 s on 2 cores, steps busy 1 + 2.5 + 0.5 = 4 s on both: 12 idle core-seconds
PILOT = run(PILOT_SPEC, OK, steps=[StepRecord(float(i), StepShape((5,)), s, 0, False)
                                   for i, s in enumerate((1.0, 2.5, 0.5))])
BASE = harvest_base(PILOT, standalone_tokens_per_s=100.0)  # 50 tokens per core-second


def test_harvest_base_is_the_pilots_idle_capacity_and_the_rate_per_core():
    assert BASE.idle.idle_core_s == 12.0 and BASE.tokens_per_core_s == 50.0
    assert BASE.as_json()["idle_share"] == pytest.approx(12 / 20)


def test_the_pilot_scores_zero():
    s = score_run(PILOT, SLO, BASE)
    assert s.harvest.ratio == 0.0 and s.metrics.harvest_ratio == 0.0
    assert s.metrics.ft_tokens_per_s == 0.0 and s.metrics.slo_attainment == 1.0


def test_split_pool_counts_commits_in_the_window_and_is_charged_its_core():
    commits = [Commit(99.0, 1000, 9, 1000),  # before the replay: not counted
               Commit(103.0, 200, 4, 250), Commit(109.5, 300, 5, 300),
               Commit(111.0, 1000, 9, 1000)]  # after it
    s = score_run(run(SPECS["split-pool"], OK, commits, HardwareShare(2, 1, 1)), SLO, BASE)
    assert s.metrics.ft_tokens_per_s == 50.0 and s.metrics.ft_samples_per_s == 0.9
    # 500 tokens ÷ ((12 idle + 1 core × 10 s) × 50)
    assert s.harvest.ratio == pytest.approx(500 / (22 * 50))
    assert s.padded_token_efficiency == pytest.approx(500 / 550)
    assert s.pair == "deltaserve" and s.as_json()["hardware_share"] == {
        "cores": 2, "host": 1, "reserved": 1}


def test_pooled_mape_weights_modes_by_steps():
    errs = (ModeError("graph", 0.10, 30, 0.2, 3), ModeError("eager", 0.02, 10, None, 0))
    assert pooled_online_mape(errs) == pytest.approx((0.10 * 30 + 0.02 * 10) / 40)
    assert pooled_online_mape(()) is None
    s = score_run(run(SPECS["deltaserve"], OK, latency=errs), SLO, BASE)
    assert s.metrics.latency_model_mape == pytest.approx(0.08)
    assert s.as_json()["latency_model_by_mode"][0] == {
        "mode": "graph", "online_mape": 0.10, "online_steps": 30, "heldout_mape": 0.2,
        "heldout_steps": 3}


def scores(**records):
    out = {"inference-only": score_run(PILOT, SLO, BASE)}
    for name, recs in records.items():
        commits = [Commit(105.0, 400 if name != "llmstation" else 100, 4, 400)]
        out[name] = score_run(run(SPECS[name], recs, commits), SLO, BASE)
    return out


def test_binding_verdicts():
    assert binding(scores(greedy=LATE, deltaserve=OK)).binds is True
    loose = binding(scores(greedy=OK, deltaserve=OK))
    assert loose.binds is False and "too loose" in loose.verdict
    both = binding(scores(greedy=LATE, deltaserve=LATE))
    assert both.binds is False and "deltaserve misses it too" in both.verdict
    assert binding(scores(deltaserve=OK)).binds is None


def test_comparisons_are_ft_ratios_with_both_attainments():
    (c,) = comparisons(scores(deltaserve=OK, llmstation=LATE))
    assert (c.system, c.baseline) == ("deltaserve", "llmstation")
    assert c.ft_ratio == pytest.approx(4.0)
    assert (c.system_attainment, c.baseline_attainment) == (1.0, 0.0)


# ---- one window for every system -----------------------------------------------------------

# the same pilot, its idle capacity counted over a 12 s window (trace 10 s + 2 s drain): its
# steps (4 s on both cores) are all inside, so 2 × 12 − 8 = 16 idle core-seconds
WINDOWED = harvest_base(PILOT, standalone_tokens_per_s=100.0, window_s=12.0)


def test_windowed_base_charges_the_idle_capacity_over_the_window():
    assert WINDOWED.idle.idle_core_s == 16.0 and WINDOWED.window_s == 12.0
    j = WINDOWED.as_json()
    assert j["window_s"] == 12.0 and j["pilot_wall_s"] == 10.0 and j["total_core_s"] == 24.0


def test_a_run_that_drains_later_gains_nothing_but_is_scored_on_every_request():
    commits = [Commit(103.0, 300, 3, 300), Commit(111.0, 300, 3, 300)]  # both in [100, 112]
    prompt = run(SPECS["deltaserve"], OK, commits, wall=11.0)
    # the same commits, then more training in a tail the prompt run does not have, and its
    # requests late enough to miss
    late = run(SPECS["greedy"], LATE, [*commits, Commit(115.0, 900, 9, 900)], wall=20.0)
    a, b = (score_run(r, SLO, WINDOWED) for r in (prompt, late))
    assert a.metrics.ft_tokens_in_window == b.metrics.ft_tokens_in_window == 600
    assert a.metrics.ft_tokens_per_s == b.metrics.ft_tokens_per_s == 50.0  # 600 / 12 s
    assert a.harvest.ratio == b.harvest.ratio == pytest.approx(600 / (16 * 50))
    assert (a.metrics.slo_attainment, b.metrics.slo_attainment) == (1.0, 0.0)
    assert b.metrics.completed_requests == 10
    # the last token (request 9's, at 9 + 2.1 on the records' clock) from the replay's start
    assert b.drained_s == pytest.approx(9 + 2.1 - 100.0)


def test_inference_only_harvests_zero_in_the_window():
    s = score_run(PILOT, SLO, WINDOWED)
    assert s.harvest.ratio == 0.0 and s.metrics.ft_tokens_in_window == 0


def test_split_pool_is_charged_its_core_for_the_window_not_its_own_run():
    s = score_run(run(SPECS["split-pool"], OK, [Commit(105.0, 600, 6, 600)],
                      HardwareShare(2, 1, 1), wall=30.0), SLO, WINDOWED)
    assert s.harvest.reserved_core_s == 12.0
    assert s.harvest.ratio == pytest.approx(600 / ((16 + 12) * 50))


def test_e2e_latency_against_inference_only():
    # OK: every request's last token 0.2 s after arrival; LATE: 2.1 s
    sc = scores(deltaserve=LATE)
    ratios = e2e_vs_inference_only(sc)
    assert ratios["inference-only"] == (pytest.approx(1.0), pytest.approx(1.0))
    assert ratios["deltaserve"] == (pytest.approx(2.1 / 0.2), pytest.approx(2.1 / 0.2))
    assert e2e_vs_inference_only({"deltaserve": sc["deltaserve"]}) == {
        "deltaserve": (None, None)}
