"""The yield reserve against closed forms: order statistics of the observed lateness."""

import math

import pytest

from deltaserve.core.errors import InputError
from deltaserve.core.yield_reserve import YieldReserve, YieldReserveConfig


def test_no_yield_before_min_steps_whatever_the_slack():
    r = YieldReserve(YieldReserveConfig(min_steps=4, window=8))
    for _ in range(3):
        r.observe(-0.01)
    assert r.reserve_s(0.002) == math.inf
    assert r.budget_s(slack_s=100.0, floor_s=0.002, cap_s=0.5) == 0.0
    r.observe(-0.01)
    assert r.budget_s(slack_s=100.0, floor_s=0.002, cap_s=0.5) == 0.5


def test_reserve_is_the_quantile_never_below_the_floor():
    late = [0.031, -0.02, 0.007, 0.050, -0.004]
    r = YieldReserve(YieldReserveConfig(quantile=1.0, window=16, min_steps=5))
    for x in late:
        r.observe(x)
    assert r.reserve_s(0.0) == max(late)  # quantile 1: the latest step seen
    assert r.reserve_s(0.2) == 0.2  # the layer-boundary floor wins
    median = YieldReserve(YieldReserveConfig(quantile=0.5, window=16, min_steps=5))
    for x in late:
        median.observe(x)
    assert median.reserve_s(-1.0) == sorted(late)[2]


def test_budget_is_the_slack_less_the_reserve_capped_and_floored():
    r = YieldReserve(YieldReserveConfig(quantile=1.0, window=4, min_steps=1, spend_fraction=1.0))
    r.observe(0.05)
    assert r.budget_s(slack_s=0.30, floor_s=0.01, cap_s=0.5) == pytest.approx(0.25)
    assert r.budget_s(slack_s=3.00, floor_s=0.01, cap_s=0.5) == 0.5
    # 0.055 - 0.05 leaves less than one floor: the backward could not finish a layer
    assert r.budget_s(slack_s=0.055, floor_s=0.01, cap_s=0.5) == 0.0
    assert r.budget_s(slack_s=-1.0, floor_s=0.01, cap_s=0.5) == 0.0
    # an SLO-blind caller's unbounded slack is capped
    assert r.budget_s(slack_s=math.inf, floor_s=0.01, cap_s=0.5) == 0.5


def test_budget_spends_only_its_fraction_of_what_the_reserve_leaves():
    r = YieldReserve(YieldReserveConfig(quantile=1.0, window=4, min_steps=1, spend_fraction=0.4))
    r.observe(0.05)
    # (0.30 - 0.05) * 0.4: the rest of the slack stays for a step later than any seen
    assert r.budget_s(slack_s=0.30, floor_s=0.01, cap_s=0.5) == pytest.approx(0.10)
    assert r.budget_s(slack_s=3.00, floor_s=0.01, cap_s=0.5) == 0.5
    # 0.4 * (0.07 - 0.05) = 0.008: less than a layer, so no yield (at fraction 1 there was one)
    assert r.budget_s(slack_s=0.07, floor_s=0.01, cap_s=0.5) == 0.0
    assert r.budget_s(slack_s=math.inf, floor_s=0.01, cap_s=0.5) == 0.5


def test_window_forgets_old_steps():
    r = YieldReserve(YieldReserveConfig(quantile=1.0, window=3, min_steps=1))
    r.observe(0.4)
    assert r.reserve_s(0.0) == 0.4
    for x in (0.01, 0.02, 0.03):
        r.observe(x)
    assert r.reserve_s(0.0) == 0.03


def test_non_finite_lateness_is_ignored():
    r = YieldReserve(YieldReserveConfig(quantile=1.0, window=4, min_steps=1))
    r.observe(math.nan)
    r.observe(math.inf)
    assert r.reserve_s(0.0) == math.inf  # nothing seen yet
    r.observe(0.02)
    assert r.reserve_s(0.0) == 0.02


@pytest.mark.parametrize("field, kwargs", [
    ("yield_reserve_quantile", {"quantile": 0.0}),
    ("yield_reserve_quantile", {"quantile": 1.5}),
    ("yield_reserve_window", {"window": 0}),
    ("yield_reserve_min_steps", {"min_steps": 600}),
    ("yield_reserve_spend_fraction", {"spend_fraction": 0.0}),
    ("yield_reserve_spend_fraction", {"spend_fraction": 1.2}),
])
def test_bad_config_names_the_field(field, kwargs):
    with pytest.raises(InputError, match=field):
        YieldReserveConfig(**kwargs)


def settled(started_s):
    """The lateness a step due at 1.0 and ended at 1.2 counts, its next step starting at
    ``started_s`` (``None``: idle, or nothing decoding)."""
    r = YieldReserve(YieldReserveConfig(quantile=1.0, window=4, min_steps=1))
    r.step_ended(due_s=1.0, ended_s=1.2)
    assert r.reserve_s(0.0) == math.inf  # nothing settled yet
    r.next_step(started_s)
    return r.reserve_s(0.0)


def test_a_step_counts_late_until_the_next_step_that_follows_it():
    # the host's 0.3 s between the step's end and the next step's view are the step's
    assert settled(1.5) == pytest.approx(0.5)
    # idle in between, or no decode waiting: only to its own end
    assert settled(None) == pytest.approx(0.2)
    # a clock read before the step ended cannot shorten it
    assert settled(1.1) == pytest.approx(0.2)


def test_an_unsettled_step_counts_to_its_end_when_the_next_one_ends():
    r = YieldReserve(YieldReserveConfig(quantile=1.0, window=4, min_steps=1))
    r.step_ended(due_s=1.0, ended_s=1.2)
    r.step_ended(due_s=2.0, ended_s=2.05)  # the host never built a view in between
    r.next_step(9.0)
    assert sorted(r._late_s) == pytest.approx([0.2, 7.0])
    r.next_step(20.0)  # settled once: nothing pending
    assert len(r._late_s) == 2
