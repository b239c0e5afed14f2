"""The service's configuration (one flag per field, see ``server.run``)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from deltaserve.core.errors import require
from deltaserve.train.checkpoint_store import CheckpointConfig

DEFAULT_BIND = "127.0.0.1"  # never every interface unless asked (issue #10)
DEFAULT_DATA_DIR = Path("deltaserve-data")


@dataclass(frozen=True)
class ServerConfig:
    """``data_dir`` holds the SQLite state, uploaded files, job checkpoints and the adapter store.
    ``bind``: the address to listen on (this machine only unless told otherwise).

    ``api_key`` None leaves the API open (only sensible on 127.0.0.1). ``metrics_public`` serves
    ``/metrics`` without the key (for a scraper on a trusted network). ``max_upload_bytes`` caps
    one file upload. ``checkpoint_every_steps``: optimizer steps between two checkpoints of a job
    (each becomes a servable ``…:ckpt-step-N`` model). ``progress_interval_s``: at most one
    progress line per job per interval in the log. ``shutdown_pause_timeout_s``: how long a clean
    shutdown waits for the running job's checkpoint before leaving it to be resumed at start-up.
    """

    data_dir: Path = DEFAULT_DATA_DIR
    bind: str = DEFAULT_BIND
    port: int = 8000
    api_key: str | None = None
    metrics_public: bool = False
    max_upload_bytes: int = 512 * 1024 * 1024
    checkpoint_every_steps: int = CheckpointConfig.every_steps
    progress_interval_s: float = 10.0
    dashboard_interval_s: float = 1.0
    dashboard_points: int = 600
    shutdown_pause_timeout_s: float = 120.0
    job_poll_interval_s: float = 0.05

    def __post_init__(self) -> None:
        try:
            ipaddress.ip_address(self.bind)
        except ValueError:
            require(self.bind == "localhost", "bind", self.bind,
                    "must be an IP address (127.0.0.1, 0.0.0.0, ::1, ...) or localhost")
        require(0 <= self.port <= 65535, "port", self.port, "must be in [0, 65535]")
        require(self.api_key is None or len(self.api_key) >= 1, "api_key", "<empty>",
                "must not be empty (omit it to leave the API open)")
        require(self.max_upload_bytes > 0, "max_upload_bytes", self.max_upload_bytes,
                "must be > 0")
        require(self.checkpoint_every_steps >= 1, "checkpoint_every_steps",
                self.checkpoint_every_steps, "must be >= 1")
        for name in ("progress_interval_s", "dashboard_interval_s", "shutdown_pause_timeout_s",
                     "job_poll_interval_s"):
            require(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        require(self.dashboard_points >= 2, "dashboard_points", self.dashboard_points,
                "must be >= 2")
