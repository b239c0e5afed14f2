"""Where misses fell: after a yield or not, by the step that emitted each late token."""

import pytest

from deltaserve.bench.miss_source import MissSources, miss_sources
from deltaserve.bench.outcome import Commit
from deltaserve.bench.score import binding, comparisons, score_run
from deltaserve.bench.systems import parse_systems
from deltaserve.core import SLOConfig, StepShape
from deltaserve.core.contract import StepRecord
from tests.bench.test_metrics import rec
from tests.bench.test_score import BASE, OK, PILOT, SPECS, run

SLO = SLOConfig(ttft_s=1.0, tpot_s=0.5)


def step(t_s, yielded_s=0.0):
    return StepRecord(t_s, StepShape(num_decode=1), 0.5, 0, False, yielded_s)


# steps end at 1, 2, 3, 4 s; a yield preceded those ending at 2 and 4
STEPS = [step(1.0), step(2.0, 0.3), step(3.0), step(4.0, 0.2)]
RECORDS = [
    rec(0, 0.0, [2.05, 2.1]),  # TTFT 2.05: its token came out of the step ending at 2: yield
    rec(1, 2.5, [3.0, 4.0]),  # TTFT 0.5 meets; the 1 s gap ends at 4: yield
    rec(2, 0.5, [3.0]),  # TTFT 2.5, the step ending at 3: no yield
    rec(3, 0.5, [1.0, 1.1]),  # meets
    rec(4, 0.0, [0.5], finished=False),  # missed (unfinished), no late token: unattributed
    rec(5, 0.0, [3.0, 4.0]),  # TTFT late at 3 (no yield), gap late at 4 (yield): yield
]
MISSED = [True, True, True, False, True, True]


def test_each_missed_request_is_attributed_by_the_steps_that_emitted_its_late_tokens():
    got = miss_sources(RECORDS, STEPS, SLO, MISSED)
    assert got == MissSources(missed=5, after_yield=3, no_yield=1, unattributed=1)
    assert got.describe() == "5 missed (3 on a step after a yield, 1 not, 1 unattributed)"
    # the same timeline without yields: every attributed miss is the steps' own
    plain = [step(s.t_s) for s in STEPS]
    assert miss_sources(RECORDS, plain, SLO, MISSED) == MissSources(5, 0, 4, 1)


def test_steps_that_overlap_in_time_are_not_one_timeline():
    overlapping = [step(1.0), step(1.2, 0.1)]  # the second started at 0.7, before 1.0
    assert miss_sources(RECORDS, overlapping, SLO, MISSED) is None


def test_the_verdict_says_where_each_system_missed():
    slo = SLOConfig(ttft_s=1.0, tpot_s=0.2)
    late = [rec(i, float(i), [i + 2.0, i + 2.1]) for i in range(10)]  # TTFT 2 s: all miss
    lent = [step(i + 2.0, 0.1) for i in range(10)]  # each first token after a yield
    commits = [Commit(105.0, 400, 4, 400)]
    scores = {"inference-only": score_run(PILOT, slo, BASE),
              "deltaserve": score_run(run(SPECS["deltaserve"], OK, commits), slo, BASE),
              "greedy": score_run(run(SPECS["greedy"], late, commits, steps=lent), slo, BASE)}
    assert scores["greedy"].misses == MissSources(10, 10, 0, 0)
    assert scores["greedy"].as_json()["misses"]["after_yield"] == 10
    b = binding(scores)
    assert b.binds is True
    assert b.verdict.endswith(
        "; misses: greedy 10 missed (10 on a step after a yield, 0 not)")
    assert "deltaserve 0 missed" not in b.verdict  # a system that met every request: no word


def test_greedy_fixed_yield_is_compared_with_greedy():
    commits = [Commit(105.0, 400, 4, 400)]
    fixed = parse_systems("greedy-fixed-yield")[1]
    scores = {"greedy": score_run(run(SPECS["greedy"], OK, commits), SLOConfig(1.0, 0.2), BASE),
              "greedy-fixed-yield": score_run(run(fixed, OK, commits), SLOConfig(1.0, 0.2),
                                              BASE)}
    (c,) = comparisons(scores)
    assert (c.system, c.baseline) == ("greedy-fixed-yield", "greedy")
    assert c.ft_ratio == pytest.approx(1.0)
