"""The simulated device shared by host steps and the backward, against closed forms."""

from __future__ import annotations

import pytest

from deltaserve.core.errors import InputError
from deltaserve.hosts.sim.clock import SimClock
from deltaserve.hosts.sim.device import GpuTimeline, JobTiming
from deltaserve.hosts.sim.modelled import ModelledParams
from deltaserve.train.config import GrantPolicy

SHARE, SLOW = 0.5, 0.2  # σ, s
PARAMS = ModelledParams(backward_share_under_decode=SHARE, decode_slowdown_under_backward=SLOW)
JOB = JobTiming(unit_s=0.002, num_layers=32, head_s=0.001, optimizer_s=0.0003)  # 65 ms local


def device(policy=GrantPolicy.PREFILL):
    clock = SimClock()
    return clock, GpuTimeline(clock, policy, PARAMS)


def test_alone_the_backward_takes_its_standalone_time():
    _, d = device()
    d.start_job(JOB)
    assert d.local_done_at() == pytest.approx(JOB.local_s)


def test_a_decode_step_and_the_backward_share_the_device():
    clock, d = device()
    d.start_job(JOB)
    base = 0.010
    step = d.begin_step(base)  # grant set: a decode-only step overlaps the backward throughout
    assert step == pytest.approx(base * (1 + SLOW))
    clock.advance_to(step)
    d.end_step()
    done = SHARE * step  # standalone seconds of backward work done beside it
    assert d.local_done_at() == pytest.approx(step + (JOB.local_s - done))


def test_a_prefill_step_parks_the_backward_at_the_next_layer_boundary():
    clock, d = device()
    d.start_job(JOB)
    clock.advance_to(0.0005)  # a quarter into layer unit 1
    d.set_grant(False)  # before_step of a prefill step
    base = 0.100
    step = d.begin_step(base)
    tail = JOB.unit_s - 0.0005  # the rest of the unit, beside the step at σ
    overlap = tail / SHARE
    assert step == pytest.approx(overlap + base - overlap / (1 + SLOW))
    assert d.local_done_at() == float("inf")  # parked at the boundary
    end = 0.0005 + step
    clock.advance_to(end)
    d.end_step()
    d.set_grant(True)  # after_step
    assert d.local_done_at() == pytest.approx(end + JOB.local_s - JOB.unit_s)
    assert d.job.parked_s == pytest.approx(step - overlap)


def test_a_job_that_ends_during_a_step_stops_slowing_it():
    clock, d = device()
    d.start_job(JOB)
    clock.advance_to(JOB.local_s - 0.001)  # 1 ms of work left
    base = 0.020
    step = d.begin_step(base)
    overlap = 0.001 / SHARE
    assert step == pytest.approx(overlap + base - overlap / (1 + SLOW))
    assert d.local_done_at() == pytest.approx(clock.now() + overlap)


def test_partitioned_cores_never_contend():
    _, d = device(GrantPolicy.PARTITION)
    d.start_job(JOB)
    d.set_grant(False)
    assert d.begin_step(0.05) == 0.05
    assert d.local_done_at() == pytest.approx(JOB.local_s)


def test_completion_waits_for_the_group():
    clock, d = device()
    d.start_job(JOB)
    clock.advance_to(JOB.local_s)
    d.finish_local()
    assert d.take_completed() is None
    d.reduce_until(JOB.local_s + 0.004)
    assert d.take_completed() is None  # not yet
    clock.advance_to(JOB.local_s + 0.004)
    job = d.take_completed()
    assert job is not None and d.job is None


def test_time_slicing_runs_the_step_after_the_backward_parks():
    clock, d = device(GrantPolicy.EXCLUSIVE)
    d.start_job(JOB)
    clock.advance_to(0.0005)  # a quarter into layer unit 1
    d.set_grant(False)  # before_step of any step
    base = 0.015
    assert d.begin_step(base) == pytest.approx(JOB.unit_s - 0.0005 + base)
    clock.advance_to(0.0005 + JOB.unit_s - 0.0005 + base)
    d.end_step()  # the grant stays cleared: parked at the boundary
    assert d.local_done_at() == float("inf")
    d.set_grant(True)  # the host lends the device (a yield, or idle time)
    assert d.local_done_at() == pytest.approx(clock.now() + JOB.local_s - JOB.unit_s)


def test_a_policy_the_device_cannot_model_is_refused_clearly():
    with pytest.raises(InputError, match="grant_policy"):
        GpuTimeline(SimClock(), GrantPolicy.AUTO, PARAMS)
