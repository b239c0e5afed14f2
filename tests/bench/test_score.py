"""Scoring a run: the harvest wired from the pilot, commits in the window, pairs, verdicts."""

import pytest

from deltaserve.bench.latency_holdout import ModeError
from deltaserve.bench.outcome import Commit, HardwareShare, SystemRun
from deltaserve.bench.replay import ReplayResult
from deltaserve.bench.score import (
    binding,
    comparisons,
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
