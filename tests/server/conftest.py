"""A live server per test (fresh data directory), stopped at the end."""

from __future__ import annotations

import pytest

from tests.server.live import server_config, start_server


@pytest.fixture
def live(tmp_path):
    server = start_server(server_config(tmp_path / "data"))
    yield server
    server.stop()
    server.backend.close()
