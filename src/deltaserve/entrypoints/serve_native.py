"""``deltaserve serve [MODEL]``: the service on the embedded engine.

Start-up order, so that bad input fails before anything heavy runs: every flag is checked by
its config class (the error names the flag and its value), then the data directory (writable),
the latency-model file if one is given (every field), the port (free), the model (a directory,
a ``.gguf`` or a built-in name, with a tokenizer). Only then does the engine load; the host is
calibrated once (or the latency model is loaded) and that model serves every job, refitting
online. The host's loop runs on its own thread for the server's lifetime; each job attaches its
own co-server to it (:class:`~deltaserve.server.coserving_runner.CoServingRunner`).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from deltaserve.core.calibration import CalibrationConfig
from deltaserve.core.errors import InputError, require
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.slo import SLOConfig
from deltaserve.hosts.native.config import EngineConfig
from deltaserve.hosts.native.engine import LLMEngine
from deltaserve.model.loading import resolve_model
from deltaserve.server.config import ServerConfig
from deltaserve.server.coserving_runner import CoServingRunner
from deltaserve.server.data_dir import DataDir
from deltaserve.server.hyperparameters import job_defaults
from deltaserve.server.run import run_server
from deltaserve.server.serving_stats import HostServingStats
from deltaserve.train.config import CoServeConfig

log = logging.getLogger("deltaserve.server")
T = TypeVar("T")
DEFAULT_SLO = SLOConfig(ttft_s=2.0, tpot_s=0.2)  # the service's objectives unless given


@dataclass(frozen=True)
class ServeConfig:
    """Every ``deltaserve serve`` flag. ``coserve`` is the co-serving config every job starts
    from (its SLO also classifies requests for the SLO-miss counters); a job sets its epochs,
    learning rate, backward batch, seed and checkpoints. ``latency_model``: a fitted latency
    model's JSON (skips the start-up calibration; its own config then applies)."""

    host: EngineConfig = field(default_factory=EngineConfig,
                               metadata={"prefix": "", "skip": ("model",)})
    server: ServerConfig = field(default_factory=ServerConfig, metadata={"prefix": ""})
    coserve: CoServeConfig = field(default_factory=lambda: CoServeConfig(slo=DEFAULT_SLO),
                                   metadata={"prefix": "", "skip": ("seed", "checkpoint")})
    latency_model: str | None = None
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)


@dataclass(frozen=True)
class Service:
    """A started host with its runner and statistics (what ``create_app`` serves)."""

    host: LLMEngine
    runner: CoServingRunner
    stats: HostServingStats


def check_port(bind: str, port: int) -> None:
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((bind, port))
        except OSError as e:
            raise InputError("--port", port, f"cannot listen on {bind}:{port}: "
                                             f"{e.strerror}") from None


def _flagged(flag: str, value: object, check: Callable[[], T]) -> T:
    """``check()``, with an input error it raises named after the flag that gave the value."""
    try:
        return check()
    except InputError as e:
        if e.field == flag:
            raise
        same = e.value == value or str(e.value) == str(value)
        raise InputError(flag, value, e.reason if same else str(e)) from None


def validate(config: ServeConfig) -> LatencyModel | None:
    """Everything checkable before the model loads; returns the latency model file's model."""
    s = config.server
    _flagged("--data-dir", str(s.data_dir), lambda: DataDir(s.data_dir))
    job_defaults(config.coserve, 1)  # a job must end: num_epochs is set
    path = config.latency_model
    latency = _flagged("--latency-model", path, lambda: LatencyModel.load(path)) \
        if path else None
    check_port(s.bind, s.port)
    model = config.host.model
    local = _flagged("MODEL", model, lambda: resolve_model(model))
    require((local / "tokenizer_config.json").is_file(), "MODEL", model,
            "has no tokenizer (tokenizer_config.json): the service tokenizes prompts and files")
    return latency


def start_service(config: ServeConfig, latency: LatencyModel | None = None) -> Service:
    """Load the engine, calibrate it once (unless ``latency`` is given), build the runner."""
    host = LLMEngine(config.host)
    if latency is None:
        log.info("calibrating the latency model (once; every job reuses it)")
        latency = host.calibrate(config.coserve.lora, config.calibration,
                                 config.coserve.latency, seed=config.host.seed, progress=True)
    host.latency_model = latency  # refit from inference-only steps between jobs
    host.request_counters.set_slo(config.coserve.slo)
    limits = host.limits
    runner = CoServingRunner(host, config.coserve, latency,
                             min(limits.max_tokens_per_step, limits.max_model_len))
    return Service(host, runner, HostServingStats(host, runner))


class HostLoop:
    """The host's stepping thread, for the server's lifetime."""

    def __init__(self, host: LLMEngine):
        self.host = host
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deltaserve-host", daemon=True)

    def _run(self) -> None:
        try:
            self.host.run_loop(self._stop)
        except Exception:  # an engine bug: nothing can serve any more
            log.critical("the host's loop stopped; inference is down", exc_info=True)

    def start(self) -> HostLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def serve(config: ServeConfig) -> None:
    """Validate, start, serve until SIGINT/SIGTERM (the running job is paused), stop."""
    latency = validate(config)
    service = start_service(config, latency)
    loop = HostLoop(service.host).start()
    try:
        run_server(config.server, service.host, service.runner, service.stats)
    finally:
        loop.stop()
        service.host.close()
