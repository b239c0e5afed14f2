"""DeltaServe as a service: the OpenAI inference, Files and Fine-tuning Jobs APIs over one
co-serving host, with SQLite state under ``--data-dir``, Prometheus ``/metrics`` and a live
``/dashboard``. Built against the Protocols in :mod:`deltaserve.server.protocols`."""

from deltaserve.server.app import create_app
from deltaserve.server.config import ServerConfig
from deltaserve.server.protocols import (
    InferenceBackend,
    ServingStats,
    ServingStatsSnapshot,
    TrainingRunner,
)
from deltaserve.server.run import add_server_args, config_from_args, run_server

__all__ = ["InferenceBackend", "ServerConfig", "ServingStats", "ServingStatsSnapshot",
           "TrainingRunner", "add_server_args", "config_from_args", "create_app", "run_server"]
