"""The simulated bench scores every system in one window, as the real bench does: fine-tuning
counts the tokens committed in the trace's duration plus the drain (simulated seconds), the
harvest charges the inference-only run's idle GPU-seconds over that same window. Closed forms
on hand-built fleet runs."""

from __future__ import annotations

import pytest

from deltaserve.bench.config import BenchConfig
from deltaserve.bench.outcome import Commit
from deltaserve.bench.sim.config import SimBenchConfig
from deltaserve.bench.sim.experiment import warn_late_pilot
from deltaserve.bench.sim.score import (
    SimOutcome,
    hardware_share,
    harvest_base,
    score,
    system_run,
)
from deltaserve.bench.systems import parse_systems
from deltaserve.core import SLOConfig, StepShape
from deltaserve.core.contract import StepRecord
from deltaserve.hosts.sim.fleet import FleetRun, RequestTimes

SPECS = {s.name: s for s in parse_systems("inference-only,deltaserve,greedy,split-pool")}
SLO = SLOConfig(ttft_s=1.0, tpot_s=0.2)
TP = 2  # GPUs per replica: a step busies both
TRACE_S, DRAIN_S = 10.0, 2.0
WINDOW_S = TRACE_S + DRAIN_S
RATE = 100.0  # standalone tokens/s on one replica's 2 GPUs: 50 per GPU-second


def requests(late_s: float = 0.0) -> list[RequestTimes]:
    """Ten requests, one a second; each's tokens ``late_s`` after it arrived (+0.1, +0.2)."""
    return [RequestTimes(i, float(i), 8, 2, 0, (i + late_s + 0.1, i + late_s + 0.2), True)
            for i in range(10)]


def outcome(name: str, reqs: list[RequestTimes], commits: list[Commit], end_s: float,
            steps: list[StepRecord] = (), replicas: int = 1) -> SimOutcome:
    fleet = FleetRun(reqs, end_s, False, [list(steps)])
    spec = SPECS[name]
    share = hardware_share(spec, replicas, TP)
    return SimOutcome(system_run(spec, fleet, commits, share), fleet, TP, WINDOW_S)


# the pilot drained at 10 s: steps of 1, 2.5 and 0.5 s (ending at 1, 4, 9.5 s) on both GPUs of
# its replica, 8 busy GPU-seconds of the window's 2 × 12: 16 idle GPU-seconds, its drained
# tail (10 to 12 s) idle
PILOT = outcome("inference-only", requests(), [], 10.0,
                [StepRecord(t, StepShape((5,)), s, 0, False)
                 for t, s in ((1.0, 1.0), (4.0, 2.5), (9.5, 0.5))])
BASE = harvest_base(PILOT, RATE, gpus=TP, tp=TP, window_s=WINDOW_S)


def test_the_window_is_the_real_benchs_trace_plus_its_drain():
    assert SimBenchConfig().drain_s == BenchConfig().drain_s
    cfg = SimBenchConfig(drain_s=DRAIN_S)
    assert cfg.window_s(TRACE_S) == BenchConfig(drain_s=DRAIN_S).window_s(TRACE_S) == WINDOW_S


def test_the_base_charges_idle_gpu_seconds_over_the_window():
    assert BASE.window_s == WINDOW_S and BASE.tokens_per_core_s == 50.0
    assert BASE.idle.total_core_s == 24.0 and BASE.idle.idle_core_s == 16.0
    assert BASE.as_json()["pilot_wall_s"] == 10.0


def test_inference_only_harvests_zero():
    s = score(PILOT, SLO, BASE).score
    assert s.harvest.ratio == 0.0 and s.metrics.harvest_ratio == 0.0
    assert s.metrics.ft_tokens_in_window == 0 and s.metrics.ft_tokens_per_s == 0.0
    assert s.metrics.slo_attainment == 1.0


def test_a_system_that_only_stretches_its_run_gains_nothing():
    commits = [Commit(3.0, 200, 2, 200), Commit(7.0, 200, 2, 200), Commit(11.9, 200, 2, 200)]
    prompt = outcome("deltaserve", requests(), commits, WINDOW_S)
    # the same commits in the window; its requests late enough to miss, its run 30 s long and
    # training all through the tail
    stretched = outcome("greedy", requests(late_s=2.0),
                        [*commits, Commit(14.0, 900, 9, 900), Commit(29.0, 900, 9, 900)], 30.0)
    a, b = (score(o, SLO, BASE).score for o in (prompt, stretched))
    assert a.metrics.ft_tokens_in_window == b.metrics.ft_tokens_in_window == 600
    assert a.metrics.ft_tokens_per_s == b.metrics.ft_tokens_per_s == 50.0  # 600 / 12 s
    assert a.harvest.ratio == b.harvest.ratio == pytest.approx(600 / (16 * 50))
    assert (a.metrics.slo_attainment, b.metrics.slo_attainment) == (1.0, 0.0)
    assert b.metrics.completed_requests == 10


def test_tokens_committed_after_the_window_do_not_count():
    # the window holds its end (12 s); a commit a hair later, however large, is not counted
    commits = [Commit(0.0, 100, 1, 100), Commit(WINDOW_S, 300, 3, 300),
               Commit(WINDOW_S + 1e-6, 5000, 50, 5000)]
    s = score(outcome("deltaserve", requests(), commits, 20.0), SLO, BASE).score
    assert s.metrics.ft_tokens_in_window == 400
    assert s.metrics.ft_samples_per_s == pytest.approx(4 / WINDOW_S)
    assert s.harvest.ratio == pytest.approx(400 / (16 * 50))


def test_split_pool_is_charged_its_trainer_gpus_for_the_window():
    # 2 replicas of 2 GPUs, one of them the trainer: 2 GPUs reserved for the 12 s window on
    # top of the idle capacity, however long its own run went on
    pilot = outcome("inference-only", requests(), [], 10.0, PILOT.run.result.steps, replicas=2)
    base = harvest_base(pilot, RATE, gpus=4, tp=TP, window_s=WINDOW_S)
    assert base.idle.idle_core_s == 4 * 12 - 8  # the pilot's steps ran on one replica's GPUs
    split = outcome("split-pool", requests(), [Commit(5.0, 600, 6, 600),
                                               Commit(25.0, 600, 6, 600)], 30.0, replicas=2)
    s = score(split, SLO, base).score
    assert s.harvest.reserved_core_s == 2 * WINDOW_S
    assert s.harvest.ratio == pytest.approx(600 / ((40 + 24) * 50))


def test_without_a_pilot_commits_still_count_in_the_window():
    base = harvest_base(None, RATE, gpus=TP, tp=TP, window_s=WINDOW_S)
    s = score(outcome("deltaserve", requests(), [Commit(5.0, 120, 1, 120),
                                                 Commit(13.0, 120, 1, 120)], 20.0),
              SLO, base).score
    assert s.metrics.ft_tokens_in_window == 120 and s.harvest.ratio is None


def test_a_pilot_still_serving_when_the_window_closed_is_warned_of(capsys):
    cfg = SimBenchConfig(drain_s=DRAIN_S)
    warn_late_pilot(cfg, {"inference-only": PILOT}, WINDOW_S)  # drained at 9.2 s
    assert capsys.readouterr().out == ""
    late = outcome("inference-only", requests(late_s=5.0), [], 20.0)  # last token at 14.2 s
    warn_late_pilot(cfg, {"inference-only": late}, WINDOW_S)
    assert "the pilot drained at 14.2 simulated s, after the 12-s window" in (
        capsys.readouterr().out)
