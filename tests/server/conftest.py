"""A live server per test on the fakes (fresh data directory), and, for the tests on the real
embedded engine, the tiny model and its latency model, made once per session."""

from __future__ import annotations

import pytest

from tests.server.live import server_config, start_server
from tests.server.real import calibrate_once, save_tiny_model


@pytest.fixture
def live(tmp_path):
    server = start_server(server_config(tmp_path / "data"))
    yield server
    server.stop()
    server.backend.close()


@pytest.fixture(scope="session")
def tiny_service(tmp_path_factory):
    """(model directory, latency-model JSON): calibrated once, every real server loads it."""
    root = tmp_path_factory.mktemp("tiny-service")
    model = save_tiny_model(root / "model")
    return model, calibrate_once(model, root / "latency.json")
