import math

import pytest

from deltaserve.core import InputError, SLOConfig, StepBudget, WaitingRequest
from deltaserve.core.slo import tpot_slack_s, ttft_slack_s

SLO = SLOConfig(ttft_s=0.4, tpot_s=0.12)


def test_ttft_slack_eq3_earliest_request():
    waiting = [WaitingRequest(arrival_s=9.8), WaitingRequest(arrival_s=9.95)]
    assert ttft_slack_s(SLO, 10.0, waiting, 0.001) == pytest.approx(0.4 - 0.2)


def test_ttft_slack_includes_queue_wait():
    # the later request waits behind 300 queued tokens at 1 ms each: it is the tighter one
    waiting = [WaitingRequest(9.8, 0), WaitingRequest(9.95, 300)]
    assert ttft_slack_s(SLO, 10.0, waiting, 0.001) == pytest.approx(0.4 - 0.05 - 0.3)


def test_no_waiting_means_no_ttft_constraint():
    assert ttft_slack_s(SLO, 10.0, [], 0.001) == math.inf


def test_tpot_slack_with_and_without_deferred_decode():
    assert tpot_slack_s(SLO, 10.0, 9.97) == pytest.approx(0.09)
    assert tpot_slack_s(SLO, 10.0, 9.97, deferred_decode_s=0.02) == pytest.approx(0.07)
    assert tpot_slack_s(SLO, 10.0, None) == math.inf


def test_delta_is_the_tighter():
    assert StepBudget(0.3, 0.1).delta_s == 0.1
    assert StepBudget(0.05, math.inf).delta_s == 0.05


@pytest.mark.parametrize("ttft,tpot,field", [
    (0, 0.1, "ttft_s"), (-1, 0.1, "ttft_s"), (0.4, 0, "tpot_s"), (math.inf, 0.1, "ttft_s"),
])
def test_impossible_slos(ttft, tpot, field):
    with pytest.raises(InputError) as e:
        SLOConfig(ttft, tpot)
    assert e.value.field == field and e.value.value == (ttft if field == "ttft_s" else tpot)


def test_ttft_slack_keeps_the_lateness_of_every_step_before_the_first_token():
    # 250 prompt tokens still queued after this step, 100 per step: three more steps, each may
    # end 20 ms past its prediction; a request whose first token is this step's keeps none
    late = [WaitingRequest(arrival_s=10.0, tokens_after_step=250)]
    assert ttft_slack_s(SLO, 10.0, late, 0.001, 0.020, 100) == pytest.approx(
        0.4 - 0.25 - 3 * 0.020)
    now = [WaitingRequest(arrival_s=10.0, tokens_after_step=0)]
    assert ttft_slack_s(SLO, 10.0, now, 0.001, 0.020, 100) == pytest.approx(0.4)
    # the tightest request wins after its steps' lateness, not before
    both = [WaitingRequest(arrival_s=9.99, tokens_after_step=0),
            WaitingRequest(arrival_s=10.0, tokens_after_step=100)]
    assert ttft_slack_s(SLO, 10.0, both, 0.0, 0.05, 100) == pytest.approx(0.4 - 0.05)
