"""The service's flags and its uvicorn runner (``deltaserve serve`` builds the backend, the
runner and the stats source, then calls :func:`run_server`).

Flags: ``--bind`` (default 127.0.0.1; named so as not to clash with ``--host``, which picks
the engine), ``--port``, ``--api-key`` (or ``$DELTASERVE_API_KEY``, which keeps the key out of
the process list), ``--metrics-public``, ``--data-dir``, ``--max-upload-bytes``,
``--checkpoint-every-steps``, ``--progress-interval-s``."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path

import uvicorn

from deltaserve.server.app import create_app
from deltaserve.server.config import ServerConfig
from deltaserve.server.protocols import InferenceBackend, ServingStats, TrainingRunner

API_KEY_ENV = "DELTASERVE_API_KEY"
DEFAULT_DATA_DIR = "deltaserve-data"


def _default(name: str):
    return next(f.default for f in dataclasses.fields(ServerConfig) if f.name == name)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("DeltaServe service")
    g.add_argument("--bind", default=_default("bind"),
                   help="address to listen on (default: %(default)s, this machine only)")
    g.add_argument("--port", type=int, default=_default("port"))
    g.add_argument("--api-key", default=None,
                   help=f"required as 'Authorization: Bearer KEY' on every route "
                        f"(default: ${API_KEY_ENV} if set)")
    g.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the API key")
    g.add_argument("--data-dir", default=DEFAULT_DATA_DIR,
                   help="files, jobs, checkpoints and adapters (default: %(default)s)")
    g.add_argument("--max-upload-bytes", type=int, default=_default("max_upload_bytes"))
    g.add_argument("--checkpoint-every-steps", type=int,
                   default=_default("checkpoint_every_steps"))
    g.add_argument("--progress-interval-s", type=float, default=_default("progress_interval_s"),
                   help="at most one progress line per job per interval in the log")


def config_from_args(ns: argparse.Namespace) -> ServerConfig:
    """Raises ``InputError`` naming a bad flag, before any model loads."""
    return ServerConfig(data_dir=Path(ns.data_dir), bind=ns.bind, port=ns.port,
                        api_key=ns.api_key or os.environ.get(API_KEY_ENV) or None,
                        metrics_public=ns.metrics_public,
                        max_upload_bytes=ns.max_upload_bytes,
                        checkpoint_every_steps=ns.checkpoint_every_steps,
                        progress_interval_s=ns.progress_interval_s)


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
