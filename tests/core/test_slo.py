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


def _decode_start_s(spend_s: float, deferred_s: float, s_per_token: float,
                    tokens_per_s: float, chunk_tokens: int = 1) -> float:
    """Brute force: a prefill-first host runs ``spend_s`` (this step and its yield), then the
    queued work ``deferred_s`` (its decode step excluded), then every prompt token that arrived
    meanwhile, ``chunk_tokens`` at a time, before the decode step. When that decode starts."""
    t = spend_s + deferred_s
    done_tokens = 0
    while True:
        arrived = math.floor(tokens_per_s * t)
        if arrived - done_tokens < chunk_tokens:
            return t + (arrived - done_tokens) * s_per_token
        t += chunk_tokens * s_per_token
        done_tokens += chunk_tokens


@pytest.mark.parametrize("rho", [0.0, 0.2, 0.5, 0.8])
def test_tpot_slack_keeps_room_for_prompts_arriving_in_the_gap(rho):
    # waited 30 ms of 120; 20 ms of queued work before the decode; prompts keep arriving,
    # taking a share rho of the host's time: spending exactly the slack lands the decode on
    # its objective (the brute-force host, token by token)
    s_per_token, waited_s, deferred_s = 1e-5, 0.03, 0.02
    tol_s = 2 * s_per_token / (1 - rho)  # a token's rounding, compounded by the arrivals
    slack_s = tpot_slack_s(SLO, 10.0, 10.0 - waited_s, deferred_s, arriving_share=rho)
    assert slack_s == pytest.approx((0.12 - waited_s) * (1 - rho) - deferred_s)
    start_s = _decode_start_s(slack_s, deferred_s, s_per_token, rho / s_per_token)
    assert waited_s + start_s == pytest.approx(0.12, abs=tol_s)
    # ignoring the arrivals (rho = 0) would have let the decode start late whenever rho > 0
    blind_s = tpot_slack_s(SLO, 10.0, 10.0 - waited_s, deferred_s)
    late_s = waited_s + _decode_start_s(blind_s, deferred_s, s_per_token, rho / s_per_token)
    assert (late_s > 0.12 + tol_s) == (rho > 0)


def test_tpot_slack_with_arrivals_at_or_past_the_limits():
    # prompts arriving as fast as the host prefills: nothing is left for a yield
    assert tpot_slack_s(SLO, 10.0, 9.97, 0.02, arriving_share=1.0) == pytest.approx(-0.02)
    assert tpot_slack_s(SLO, 10.0, 9.97, 0.02, arriving_share=3.0) == pytest.approx(-0.02)
    # a gap already past its objective shares nothing: the overrun counts whole
    assert tpot_slack_s(SLO, 10.0, 9.8, 0.0, arriving_share=0.5) == pytest.approx(-0.08)
