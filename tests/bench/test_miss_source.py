"""Where misses fell: after a yield or not, by the step that emitted each late token."""

import pytest

from deltaserve.bench.miss_source import LateEvent, miss_sources
from deltaserve.bench.outcome import Commit
from deltaserve.bench.repeats import _total_misses
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
    assert (got.missed, got.after_yield, got.no_yield, got.unattributed) == (5, 3, 1, 1)
    assert got.describe() == "5 missed (3 on a step after a yield, 1 not, 1 unattributed)"
    # the same timeline without yields: every attributed miss is the steps' own
    plain = [step(s.t_s) for s in STEPS]
    got = miss_sources(RECORDS, plain, SLO, MISSED)
    assert (got.missed, got.after_yield, got.no_yield, got.unattributed) == (5, 0, 4, 1)


def test_each_late_event_says_what_its_span_held():
    events = {(e.request, e.event): e for e in miss_sources(RECORDS, STEPS, SLO, MISSED).events}
    assert set(events) == {(0, "ttft"), (1, "tpot"), (2, "ttft"), (5, "ttft"), (5, "tpot")}
    # request 0 waited 2.05 s: the steps ending at 1 and 2 (0.5 s each, 0.3 s lent before the
    # second), and 0.75 s of neither
    assert events[0, "ttft"] == LateEvent(0, "ttft", 1050.0, 2.05, 2, 1.0, 0.3, 0, 0.75,
                                          longest="1 decode")
    # request 1's gap from 3 to 4 s: the step ending at 4 and the 0.2 s lent before it
    assert events[1, "tpot"] == LateEvent(1, "tpot", 500.0, 1.0, 1, 0.5, 0.2, 0, 0.3,
                                          longest="1 decode")
    # request 2 arrived at 0.5 s, inside the step ending at 1: only its part after counts
    e = events[2, "ttft"]
    assert (e.steps, e.step_s, e.yielded_s) == (3, pytest.approx(1.5), pytest.approx(0.3))


def test_a_late_event_sets_its_steps_beside_what_the_model_predicted_for_them():
    big = StepShape((384, 128), num_decode=7, ft_lens=(64,))
    steps = [step(1.0), StepRecord(2.0, big, 0.9, 64, False, 0.3),
             StepRecord(3.0, StepShape(num_decode=1), 0.45, 0, False)]
    predicted = {(STEPS[0].shape, 0.5): 0.4, (big, 0.9): 0.6}
    events = {(e.request, e.event): e
              for e in miss_sources(RECORDS, steps, SLO, MISSED, predicted).events}
    # request 0's span held the steps ending at 1 and 2: 0.4 + 0.6 s predicted, the second the
    # longer (0.9 s), with what it carried
    assert events[0, "ttft"].predicted_s == pytest.approx(1.0)
    assert events[0, "ttft"].longest == "prefill 512 (2) + 7 decodes + ft 64"
    # a step the model never predicted (the one ending at 3 has no entry): unknown, not 0
    assert events[2, "ttft"].predicted_s is None
    assert miss_sources(RECORDS, steps, SLO, MISSED).events[0].predicted_s is None


def test_repeats_add_up_their_misses_and_keep_each_events_repeat():
    one = miss_sources(RECORDS, STEPS, SLO, MISSED)
    total = _total_misses([one, one])
    assert (total.missed, total.after_yield, total.no_yield) == (10, 6, 2)
    assert [e.repeat for e in total.events] == [0] * 5 + [1] * 5


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
    m = scores["greedy"].misses
    assert (m.missed, m.after_yield, m.no_yield, m.unattributed) == (10, 10, 0, 0)
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
