"""The exclusive grant around host steps: a step waits for the backward's layer boundary."""

import threading
import types

from deltaserve.core.shape import StepShape
from deltaserve.train.backward.driver import BackwardDriver
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
    driver.layer_s = 0.01  # the running estimate of a decoder layer
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
