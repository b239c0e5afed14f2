"""The exclusive grant around host steps: a step waits for the backward's layer boundary; a
yield ends early once the backward waits for a unit that would not end within it."""

import multiprocessing as mp
import threading
import time
import types

from deltaserve.core.shape import StepShape
from deltaserve.train.backward.driver import BackwardDriver
from deltaserve.train.backward.grant import Grant
from deltaserve.train.backward.process import BackwardProcess
from deltaserve.train.config import BackwardConfig, GrantPolicy


class _Process:
    """A backward process mid-layer: ``parked`` turns 1 when ``finish`` is set (the layer in
    progress ended after the grant was taken back)."""

    wait_parked = BackwardProcess.wait_parked

    def __init__(self):
        self.grant = threading.Event()
        self.grant.set()
        self.parked = types.SimpleNamespace(value=0)
        self.in_flight = object()


def _driver(park_timeout_s: float) -> tuple[BackwardDriver, _Process]:
    driver = object.__new__(BackwardDriver)  # no worker process: the grant logic alone
    driver.config = BackwardConfig(grant_policy=GrantPolicy.EXCLUSIVE, threads=1,
                                   park_timeout_s=park_timeout_s)
    driver._layer_ema_s = 0.01  # the running estimate of a decoder layer
    driver.process = process = _Process()
    return driver, process


def test_step_waits_out_a_layer_far_longer_than_the_estimate():
    # the layer through the LM head: 30x the decoder-layer estimate
    driver, process = _driver(park_timeout_s=10.0)
    timer = threading.Timer(0.3, lambda: setattr(process.parked, "value", 1))
    timer.start()
    driver.before_step(StepShape(num_decode=1))
    assert not process.grant.is_set()
    assert process.parked.value == 1  # the step starts only once the backward stopped


def test_hung_backward_delays_a_step_only_until_the_timeout():
    driver, process = _driver(park_timeout_s=0.05)
    driver.before_step(StepShape(num_decode=1))  # returns: inference goes on
    assert not process.grant.is_set() and process.parked.value == 0


def _lending(parked: int, waiting_s: float) -> BackwardDriver:
    """A driver over a real grant, its backward parked (or computing) and waiting to start a
    unit of ``waiting_s`` (0: none)."""
    driver = object.__new__(BackwardDriver)
    driver._layer_ema_s = 0.01
    grant = Grant(mp.get_context("spawn"))
    grant.waiting_s = waiting_s
    driver.process = types.SimpleNamespace(grant=grant, parked=types.SimpleNamespace(value=parked))
    return driver


def test_a_yield_ends_once_the_backward_waits_for_a_unit_longer_than_its_rest():
    driver = _lending(parked=1, waiting_s=30.0)
    assert driver.layer_s == 30.0  # the grain the next yield must hold
    t0 = time.monotonic()
    given = driver.lend(5.0, threading.Event())
    assert given < 2.5 and time.monotonic() - t0 < 2.5  # handed back long before its end
    assert driver.process.grant.admits(0.0)  # the grant stays lent; the host takes it back


def test_a_yield_ends_once_the_backward_is_parked_with_no_unit_to_start():
    """Its job ended (or a data-parallel replica waits for its peers): nothing to lend for."""
    assert _lending(parked=1, waiting_s=0.0).lend(5.0, threading.Event()) < 2.5


def test_a_yield_runs_its_length_while_the_backward_computes_or_its_unit_fits():
    for parked, waiting_s in ((0, 0.0), (1, 0.001)):
        driver = _lending(parked, waiting_s)
        # a waiting unit ends the yield once it would not end by then: at most its length early
        # (a timed wait may return a little before its deadline, as here by 49 us)
        assert driver.lend(0.05, threading.Event()) >= 0.05 - waiting_s, (parked, waiting_s)
    assert _lending(0, 0.0).layer_s == 0.01
    wake = threading.Event()
    wake.set()  # an arrival ends it at once
    assert _lending(0, 0.0).lend(5.0, wake) < 2.5
