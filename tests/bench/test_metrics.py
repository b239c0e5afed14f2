import pytest

from deltaserve.bench import metrics as M
from deltaserve.bench.replay import RequestRecord
from deltaserve.core import InputError, SLOConfig, StepShape
from deltaserve.core.contract import StepRecord

SLO = SLOConfig(ttft_s=1.0, tpot_s=0.2)


def rec(i, scheduled, times, finished=True):
    return RequestRecord(i, scheduled, 10, len(times), tuple(times), finished)


RECORDS = [
    rec(0, 0.0, [0.5, 0.6, 0.7]),  # meets: ttft .5, max gap .1
    rec(1, 1.0, [2.5, 2.6]),  # ttft 1.5 > 1.0
    rec(2, 2.0, [2.2, 2.3, 2.8]),  # max gap .5 > .2
    rec(3, 3.0, [3.9]),  # meets: one token, no gap
    rec(4, 4.0, [4.1], finished=False),  # never finished: misses
]


def test_slo_per_request():
    assert [M.meets_slo(r, SLO) for r in RECORDS] == [True, False, False, True, False]
    assert M.attainment(RECORDS, SLO) == pytest.approx(2 / 5)


def test_compute_known_answers():
    m = M.compute(RECORDS, SLO, window_s=10.0, ft_tokens=500, ft_samples=5,
                  latency_model_mape=0.04, harvest=0.9)
    assert m.ft_tokens_per_s == 50 and m.ft_samples_per_s == 0.5
    assert m.completed_requests == 4
    ttfts = [0.5, 1.5, 0.2, 0.9, 0.1]
    assert m.ttft_p50_ms == pytest.approx(500)
    assert m.ttft_p99_ms == pytest.approx(1e3 * (0.9 + 0.96 * (1.5 - 0.9)))
    assert sorted(ttfts)[2] == 0.5
    assert m.tpot_p99_ms == pytest.approx(1e3 * (0.1 + 0.97 * (0.5 - 0.1)))
    assert m.mean_e2e_s == pytest.approx((0.7 + 1.6 + 0.8 + 0.9) / 4)
    # finished requests' end-to-end latencies 0.7, 0.8, 0.9, 1.6: p95 at rank 0.95 × 3 = 2.85
    assert m.e2e_p95_s == pytest.approx(0.9 + 0.85 * (1.6 - 0.9))
    assert m.ft_tokens_in_window == 500
    assert set(m.as_json()) == {
        "ft_tokens_per_s", "ft_samples_per_s", "slo_attainment", "ttft_p50_ms", "ttft_p99_ms",
        "tpot_p99_ms", "mean_e2e_s", "completed_requests", "latency_model_mape",
        "harvest_ratio", "ft_tokens_in_window", "e2e_p95_s"}


def test_p99_latencies_are_the_slo_derivation_inputs():
    ttft, tpot = M.p99_latencies_ms(RECORDS)
    # TTFTs of every request with a first token; longest gaps of finished requests only
    assert ttft == pytest.approx(1e3 * (0.9 + 0.96 * (1.5 - 0.9)))
    assert tpot == pytest.approx(1e3 * (0.1 + 0.97 * (0.5 - 0.1)))
    assert M.p99_latencies_ms([]) == (None, None)


def test_empty_run():
    m = M.compute([], SLO, 1.0, 0, 0, None)
    assert m.slo_attainment == 1.0 and m.ttft_p50_ms is None and m.completed_requests == 0


# ---- harvest in core-seconds: hand-computed cases (module docstring's formula) ------------

def steps_of(*seconds):
    return [StepRecord(float(i), StepShape((5,)), s, 0, False) for i, s in enumerate(seconds)]


# Inference alone on a 2-core machine for 10 s, its steps busy 4 s on both cores:
# 2 × 10 − 4 × 2 = 12 idle core-seconds. Standalone training: 100 tokens/s on 2 cores.
IDLE = M.idle_capacity(steps_of(1.0, 2.5, 0.5), wall_s=10.0, cores=2)
RATE = M.tokens_per_core_s(100.0, 2)  # 50 tokens per core-second


def test_idle_capacity_is_core_seconds_inference_left_unused():
    assert IDLE.total_core_s == 20.0 and IDLE.busy_core_s == 8.0 and IDLE.idle_core_s == 12.0
    # a host whose steps ran on one of the two cores left the other idle throughout
    one = M.idle_capacity(steps_of(1.0, 2.5, 0.5), wall_s=10.0, cores=2, step_cores=1)
    assert one.busy_core_s == 4.0 and one.idle_core_s == 16.0
    assert M.idle_capacity([], 3.0, cores=4).idle_core_s == 12.0
    # steps timed inside the wall clock may round past it: never negative
    assert M.idle_capacity(steps_of(5.0, 5.01), 10.0, cores=1).idle_core_s == 0.0


def test_inference_only_scores_zero():
    h = M.harvest(0, IDLE, RATE)
    assert h.ratio == 0.0 and h.training_core_s == 12.0


def test_training_only_in_idle_gaps_is_charged_the_idle_capacity():
    # 300 tokens ÷ (12 core·s × 50 tokens/(core·s)) = 0.5
    h = M.harvest(300, IDLE, RATE)
    assert h.reserved_core_s == 0.0
    assert h.ratio == pytest.approx(300 / (12 * 50))
    assert h.ratio == pytest.approx(0.5)
    # every idle core-second trained at the standalone rate: exactly 1
    assert M.harvest(600, IDLE, RATE).ratio == pytest.approx(1.0)


def test_a_trainer_holding_a_core_is_charged_for_it_all_run():
    # split pool: its trainer holds one of the two cores for the 10 s replay. It is charged
    # 12 idle + 1 × 10 reserved = 22 core·s. Its core training at the standalone rate for the
    # whole run makes 10 × 50 = 500 tokens: 500 / (22 × 50) ≈ 0.4545.
    h = M.harvest(500, IDLE, RATE, reserved_cores=1, window_s=10.0)
    assert h.reserved_core_s == 10.0 and h.training_core_s == 22.0
    assert h.ratio == pytest.approx(500 / 1100)
    # it cannot score above what its own core could train: even a fully busy inference run
    # (no idle capacity) leaves it at most 1 when its core trains at the standalone rate
    busy = M.idle_capacity(steps_of(10.0), wall_s=10.0, cores=2)
    assert busy.idle_core_s == 0.0
    assert M.harvest(500, busy, RATE, reserved_cores=1, window_s=10.0).ratio == pytest.approx(1.0)
    assert M.harvest(500, M.idle_capacity(steps_of(7.0), 10.0, 2), RATE, 1, 10.0).ratio \
        == pytest.approx(500 / ((6 + 10) * 50))


def test_a_partitioned_backward_is_charged_like_a_split_pool():
    # co-serving with the backward pinned to one core of two: same charge as split pool, so
    # whatever it harvests in the host's idle gaps and steps must beat 22 core·s × rate to be 1
    h = M.harvest(1100, IDLE, RATE, reserved_cores=1, window_s=10.0)
    assert h.ratio == pytest.approx(1.0)
    assert h.as_json() == {"ft_tokens": 1100, "idle_core_s": 12.0, "reserved_core_s": 10.0,
                           "standalone_tokens_per_core_s": 50.0, "training_core_s": 22.0,
                           "ratio": pytest.approx(1.0)}


# ---- one window for every system: the sanity cases in closed form ---------------------------

# The pilot on 2 cores: 10 s trace, steps ending at t = 1, 4 and 11.5 s (1, 2.5 and 0.5 s long).
# A window of 12 s (the trace + a 2 s drain) from t = 0: idle = 2 × 12 − 2 × 4 = 16 core·s.
WINDOW_S = 12.0
PILOT_STEPS = [StepRecord(t, StepShape((5,)), s, 0, False)
               for t, s in ((1.0, 1.0), (4.0, 2.5), (11.5, 0.5))]
WINDOW_IDLE = M.idle_capacity(PILOT_STEPS, WINDOW_S, cores=2, end_s=WINDOW_S)


def test_idle_capacity_over_the_window_counts_only_steps_inside_it():
    assert WINDOW_IDLE.total_core_s == 24.0 and WINDOW_IDLE.idle_core_s == 16.0
    # a window closing at 11.25 s cuts the last step (11.0 to 11.5 s) to its first 0.25 s
    cut = M.idle_capacity(PILOT_STEPS, 11.25, cores=2, end_s=11.25)
    assert cut.busy_core_s == pytest.approx(2 * (1.0 + 2.5 + 0.25))
    # a step wholly after the window is not busy in it
    assert M.idle_capacity(PILOT_STEPS, 1.2, cores=2, end_s=1.2).busy_core_s == 2.0


def test_inference_only_harvests_zero_in_the_window():
    h = M.harvest(M.window_tokens([], 0.0, WINDOW_S), WINDOW_IDLE, RATE, 0, WINDOW_S)
    assert h.ratio == 0.0
    assert M.compute(RECORDS, SLO, WINDOW_S, 0, 0, None, h.ratio).ft_tokens_per_s == 0.0


def test_stretching_the_run_gains_nothing():
    # two systems commit the same 600 tokens at the same times; the second drains its requests
    # later and keeps training in its tail (commits at 14 and 20 s, after the 12 s window)
    prompt = [(3.0, 200), (7.0, 200), (11.9, 200)]
    stretched = [*prompt, (14.0, 500), (20.0, 500)]
    a = M.window_tokens(prompt, 0.0, WINDOW_S)
    b = M.window_tokens(stretched, 0.0, WINDOW_S)
    assert a == b == 600
    ha, hb = (M.harvest(t, WINDOW_IDLE, RATE, 0, WINDOW_S) for t in (a, b))
    assert ha.ratio == hb.ratio == pytest.approx(600 / (16 * 50))
    ma, mb = (M.compute(RECORDS, SLO, WINDOW_S, t, 3, None) for t in (a, b))
    assert ma.ft_tokens_per_s == mb.ft_tokens_per_s == 50.0
    # a split pool's trainer is charged its core for the window, not for its own longer run
    assert M.harvest(b, WINDOW_IDLE, RATE, 1, WINDOW_S).reserved_core_s == WINDOW_S


def test_the_window_holds_both_ends():
    assert [M.in_window(t, 5.0, 2.0) for t in (4.99, 5.0, 7.0, 7.01)] == [
        False, True, True, False]


def test_nothing_charged_has_no_ratio():
    busy = M.idle_capacity(steps_of(10.0), wall_s=10.0, cores=2)
    assert M.harvest(0, busy, RATE).ratio is None
    assert M.harvest(100, IDLE, 0.0).ratio is None


@pytest.mark.parametrize("call,field", [
    (lambda: M.idle_capacity([], 1.0, cores=0), "cores"),
    (lambda: M.idle_capacity([], 1.0, cores=2, step_cores=3), "step_cores"),
    (lambda: M.idle_capacity([], -1.0, cores=2), "wall_s"),
    (lambda: M.window_tokens([(0.0, 1)], 0.0, 0.0), "window_s"),
    (lambda: M.tokens_per_core_s(-1.0, 2), "standalone_tokens_per_s"),
    (lambda: M.harvest(-1, IDLE, RATE), "ft_tokens"),
    (lambda: M.harvest(1, IDLE, RATE, reserved_cores=3, window_s=1.0), "reserved_cores"),
    (lambda: M.harvest(1, IDLE, RATE, reserved_cores=1), "window_s"),
    (lambda: M.harvest(1, IDLE, -2.0), "standalone_tokens_per_core_s"),
])
def test_bad_accounting_input_names_the_field(call, field):
    with pytest.raises(InputError) as e:
        call()
    assert e.value.field == field
