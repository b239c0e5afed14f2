"""The service's flags and its uvicorn runner (``deltaserve serve`` builds the backend, the
runner and the stats source, then calls :func:`run_server`).

The flags are generated from :class:`ServerConfig` (:mod:`deltaserve.cli_flags`): ``--bind``
(default 127.0.0.1), ``--port``, ``--api-key`` (or ``$DELTASERVE_API_KEY``, which keeps the key
out of the process list), ``--metrics-public``, ``--data-dir``, ``--max-upload-bytes``,
``--checkpoint-every-steps``, ``--progress-interval-s``, ..."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

import uvicorn

from deltaserve.cli_flags import add_dataclass_flags, from_args
from deltaserve.server.app import create_app
from deltaserve.server.config import ServerConfig
from deltaserve.server.protocols import InferenceBackend, ServingStats, TrainingRunner

API_KEY_ENV = "DELTASERVE_API_KEY"


def add_server_args(parser: argparse.ArgumentParser, dest: str = "") -> None:
    add_dataclass_flags(parser.add_argument_group("DeltaServe service"), ServerConfig,
                        dest=dest)


def config_from_args(ns: argparse.Namespace, dest: str = "") -> ServerConfig:
    """Raises ``InputError`` naming a bad flag, before any model loads."""
    config = from_args(ServerConfig, ns, dest)
    if config.api_key is None and os.environ.get(API_KEY_ENV):
        config = dataclasses.replace(config, api_key=os.environ[API_KEY_ENV])
    return config


def run_server(config: ServerConfig, backend: InferenceBackend, runner: TrainingRunner,
               stats: ServingStats) -> None:
    """Serve until SIGINT/SIGTERM; then the running job is checkpointed and left paused."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    if config.api_key is None and config.bind not in ("127.0.0.1", "::1", "localhost"):
        logging.getLogger("deltaserve.server").warning(
            "listening on %s without an API key: anyone who reaches it can train and serve",
            config.bind)
    app = create_app(config, backend, runner, stats)
    uvicorn.run(app, host=config.bind, port=config.port, log_level="info",
                timeout_graceful_shutdown=5)
