"""``deltaserve serve [MODEL]``: the service on the embedded engine.

Start-up order, so that bad input fails before anything heavy runs: every flag is checked by
its config class (the error names the flag and its value), then the data directory (writable),
the latency-model file if one is given (every field), the port (free), the model (a directory,
a ``.gguf`` or a built-in name, with a tokenizer). Only then does the engine load; the host is
calibrated once (or the latency model is loaded) and that model serves every job, refitting
online. The host's loop runs on its own thread for the server's lifetime; each job attaches its
own co-server to it (:class:`~deltaserve.server.coserving_runner.CoServingRunner`).

``--replicas N``: N engines in this process, each on its share of the CPU threads and its own
copy of the latency model (calibrated once, on the first), each with its own loop thread,
behind one router and one job queue whose jobs train data-parallel across every replica
(:mod:`deltaserve.server.replicas`).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from deltaserve.core.calibration import CalibrationConfig
from deltaserve.core.errors import InputError, require
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.router import DEFAULT_ROUTER, check_router, create_router
from deltaserve.core.slo import SLOConfig
from deltaserve.hosts.native.config import EngineConfig
from deltaserve.hosts.native.engine import LLMEngine
from deltaserve.model.loading import resolve_model
from deltaserve.server.config import ServerConfig
from deltaserve.server.coserving_runner import CoServingRunner
from deltaserve.server.data_dir import DataDir
from deltaserve.server.hyperparameters import job_defaults
from deltaserve.server.protocols import InferenceBackend
from deltaserve.server.replicas import ReplicaBackend, replica_runner
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
    replicas: int = 1
    router: str = DEFAULT_ROUTER

    def __post_init__(self) -> None:
        require(isinstance(self.replicas, int) and self.replicas >= 1, "replicas",
                self.replicas, "must be an integer >= 1")
        check_router(self.router)


@dataclass(frozen=True)
class Service:
    """Started hosts (one per replica) with the backend, runner and statistics that
    ``create_app`` serves."""

    hosts: tuple[LLMEngine, ...]
    backend: InferenceBackend
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
    cpus = len(os.sched_getaffinity(0))
    require(config.replicas <= cpus, "--replicas", config.replicas,
            f"each replica needs a CPU thread of its own; this process has {cpus}")
    model = config.host.model
    local = _flagged("MODEL", model, lambda: resolve_model(model))
    require((local / "tokenizer_config.json").is_file(), "MODEL", model,
            "has no tokenizer (tokenizer_config.json): the service tokenizes prompts and files")
    return latency


def start_service(config: ServeConfig, latency: LatencyModel | None = None) -> Service:
    """Load the engines, calibrate once (unless ``latency`` is given), build the runner."""
    n = config.replicas
    engine = config.host
    if n > 1 and engine.num_threads is None:
        engine = replace(engine, num_threads=max(1, len(os.sched_getaffinity(0)) // n))
    hosts = tuple(LLMEngine(engine) for _ in range(n))
    if latency is None:
        log.info("calibrating the latency model (once; every job reuses it)")
        latency = hosts[0].calibrate(config.coserve.lora, config.calibration,
                                     config.coserve.latency, seed=engine.seed, progress=True)
    for i, host in enumerate(hosts):
        # each refits online from its own steps
        host.latency_model = latency if i == 0 else copy.deepcopy(latency)
        host.request_counters.set_slo(config.coserve.slo)
    limits = hosts[0].limits
    max_sample_tokens = min(limits.max_tokens_per_step, limits.max_model_len)
    if n == 1:
        backend: InferenceBackend = hosts[0]
        runner = CoServingRunner(hosts[0], config.coserve, latency, max_sample_tokens)
    else:
        backend = ReplicaBackend(hosts, create_router(config.router, n))
        runner = replica_runner(hosts, config.coserve, max_sample_tokens)
    return Service(hosts, backend, runner, HostServingStats(hosts, runner))


class HostLoop:
    """The host's stepping thread, for the server's lifetime. ``on_failure``: called once if
    the loop raises (a replica's: the router goes around it)."""

    def __init__(self, host: LLMEngine, on_failure: Callable[[], None] | None = None):
        self.host = host
        self.on_failure = on_failure
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deltaserve-host", daemon=True)

    def _run(self) -> None:
        try:
            self.host.run_loop(self._stop)
        except Exception:  # an engine bug: this engine serves no more
            log.critical("the host's loop stopped; its inference is down", exc_info=True)
            if self.on_failure is not None:
                self.on_failure()

    def start(self) -> HostLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def host_loops(service: Service) -> list[HostLoop]:
    """Every host's loop, started; a replica's failure marks it down in the router."""
    backend = service.backend
    return [HostLoop(host, functools.partial(backend.replica_down, i)
                     if isinstance(backend, ReplicaBackend) else None).start()
            for i, host in enumerate(service.hosts)]


def serve(config: ServeConfig) -> None:
    """Validate, start, serve until SIGINT/SIGTERM (the running job is paused), stop."""
    latency = validate(config)
    service = start_service(config, latency)
    loops = host_loops(service)
    try:
        run_server(config.server, service.backend, service.runner, service.stats)
    finally:
        for loop in loops:
            loop.stop()
        for host in service.hosts:
            host.close()
