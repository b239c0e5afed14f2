"""The client half every host shares, and the engine half each host implements.

Clients call :meth:`BaseHost.add_request` (any thread), :meth:`~BaseHost.generate`,
:meth:`~BaseHost.abort_request`, :meth:`~BaseHost.add_lora`; one thread drives the engine with
:meth:`~BaseHost.run_loop` (or :meth:`~BaseHost.step`). Client requests and adapter changes are
queued and handed to the engine between steps, from the thread that steps it, so no engine has
to be thread-safe. Outputs come back through :meth:`BaseHost._emit`, which keeps each request's
token times (the same clock, ``time.monotonic()``, on every host).

A host subclass implements the engine half: ``_engine_submit``, ``_engine_abort``,
``_engine_step``, ``_load_lora``/``_unload_lora``, and the co-server's side of the contract
(:class:`deltaserve.core.contract.TrainingHost`).
"""

from __future__ import annotations

import itertools
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from deltaserve.core.admission import AdmissionScheduler
from deltaserve.core.calibration import CalibrationConfig
from deltaserve.core.contract import CoServingHooks, StepRecord, TrainingHost
from deltaserve.core.errors import InputError
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.pool import SamplePool
from deltaserve.core.request_stats import RequestCounters
from deltaserve.core.requests import RequestOutput, SamplingParams, TokenCallback
from deltaserve.core.shape import StepShape
from deltaserve.core.tokenizer import Tokenizer
from deltaserve.hosts.config import HostConfig
from deltaserve.hosts.gc_pauses import GcClock
from deltaserve.train.attach import (
    Dataset,
    LatencySource,
    TorchTraining,
    TrainingHalf,
    attach,
    detach,
)
from deltaserve.train.config import CoServeConfig
from deltaserve.train.facade import CoServer

# Adapter names a client may never use: the co-server's training adapter has no client name.
RESERVED_ADAPTER_PREFIX = "deltaserve-"
StepListener = Callable[[StepRecord], None]
Clock = Callable[[], float]


@dataclass(eq=False)
class ClientRequest:
    """A client request from ``add_request`` until its last output."""

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    adapter: str | None
    callback: TokenCallback | None
    arrival_s: float
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, tuple(self.tokens), self.text,
                             self.finished, self.finish_reason, self.arrival_s,
                             self.times[0] if self.times else None, tuple(self.times))


class BaseHost(TrainingHost, ABC):
    """Every host is a :class:`TrainingHost` (the subclass implements the training side), so
    one attach, :meth:`attach`, serves them all."""

    config_cls: type[HostConfig] = HostConfig  # what the registry builds a host from
    config: HostConfig  # every host is built from one (set by the subclass)

    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int,
                 clock: Clock = time.monotonic):
        """``clock``: the time every arrival, token and step is stamped with (a simulated
        host passes its simulated clock)."""
        self._tokenizer = tokenizer
        self._clock = clock
        # garbage collection is real time: a host on a simulated clock records none
        self._gc = GcClock() if clock is time.monotonic else None
        self.max_model_len = max_model_len
        # output tokens, finished requests and SLO misses (a server's /metrics reads them)
        self.request_counters = RequestCounters()
        self.coserver: CoServingHooks | None = None
        self.latency_model: LatencyModel | None = None  # refit from inference-only steps
        self._co: CoServer | None = None
        self._lock = threading.Lock()
        self._step_lock = threading.Lock()
        self._wake = threading.Event()
        self._incoming: deque[ClientRequest] = deque()
        self._aborts: deque[str] = deque()
        self._lora_ops: deque[tuple[str, str | None]] = deque()
        self._adapters: set[str] = set()
        self._live: dict[str, ClientRequest] = {}
        self._finished: dict[str, RequestOutput] = {}
        self._step_listeners: list[StepListener] = []
        self._between: deque[tuple[Callable[[], None], Future[None]]] = deque()
        self._looping = False
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    @property
    def model_name(self) -> str:
        """The base model as clients name it: the ``model`` the host was started with."""
        return self.config.model

    # ---- clients ----------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    adapter: str | None = None, callback: TokenCallback | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (thread-safe). ``callback`` receives a :class:`RequestOutput` after
        every new token and once finished; without one, :meth:`pop_finished` returns it."""
        params = params or SamplingParams()
        ids = self._prompt_ids(prompt)
        if params.stop and self._tokenizer is None:
            raise InputError("stop", params.stop, "stop strings need a tokenizer")
        if adapter is not None:
            self._check_adapter(adapter)
        with self._lock:
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self._live or rid in self._finished:
                raise InputError("request_id", rid, "is already in use")
            req = ClientRequest(rid, tuple(ids), params, adapter, callback, self._clock())
            self._live[rid] = req
            self._incoming.append(req)
        co = self.coserver
        if co is not None:
            co.on_arrival()
        self._wake.set()
        return rid

    def abort_request(self, request_id: str) -> None:
        """Stop a request (thread-safe); its client receives a last output, ``abort``."""
        with self._lock:
            if request_id in self._live:
                self._aborts.append(request_id)
        self._wake.set()

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | None = None, adapter: str | None = None
                 ) -> list[RequestOutput]:
        """Run ``prompts`` to completion from the calling thread."""
        ids = [self.add_request(p, params, adapter=adapter) for p in prompts]
        while any(i not in self._finished for i in ids):
            if not self.step() and self.coserver is not None:
                self.coserver.idle(0.001)
        return [self.pop_finished(i) for i in ids]

    def pop_finished(self, request_id: str) -> RequestOutput:
        with self._lock:
            return self._finished.pop(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live)

    # ---- adapters served by name ------------------------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at ``path`` as ``name`` from the next step on (thread-safe)."""
        if not name or name.startswith(RESERVED_ADAPTER_PREFIX):
            raise InputError("adapter", name, f"names starting with {RESERVED_ADAPTER_PREFIX!r} "
                             "are reserved")
        self._load_lora(name, path)  # validate and load now, so errors reach the caller
        with self._lock:
            self._adapters.add(name)

    def remove_lora(self, name: str) -> None:
        with self._lock:
            self._adapters.discard(name)
            self._lora_ops.append((name, None))
        self._wake.set()

    def lora_names(self) -> list[str]:
        with self._lock:
            return sorted(self._adapters)

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> bool:
        """One engine step (queued clients and aborts handed over first); ``False`` when there
        was nothing to run. One thread at a time: a concurrent call raises."""
        if not self._step_lock.acquire(blocking=False):
            raise RuntimeError("step() is already running in another thread: drive a host from "
                               "one thread (run_loop), and call add_request from the others")
        try:
            self._wake.clear()  # arrivals from here on wake a wait early
            self._hand_over()
            return self._engine_step()
        finally:
            self._step_lock.release()

    def run_loop(self, stop: threading.Event, idle_wait_s: float = 0.005) -> None:
        """Step until ``stop`` is set. With nothing to run, lend the machine to the backward
        while co-serving has work, else wait for an arrival."""
        self._looping = True
        try:
            while not stop.is_set():
                if self.step():
                    continue
                co = self.coserver
                if co is not None and co.wants_step():
                    co.idle(idle_wait_s)
                else:
                    self._wake.wait(idle_wait_s)
        finally:
            self._looping = False
            self._run_between_steps()  # calls queued as the loop ended

    def call_between_steps(self, fn: Callable[[], None], timeout_s: float = 60.0) -> None:
        """Run ``fn`` on the stepping thread between two steps and wait for it (at once, on
        the caller's thread, when no loop runs). Raises what ``fn`` raised; ``TimeoutError``
        if the loop does not get to it in ``timeout_s``."""
        if not self._looping:
            fn()
            return
        done: Future[None] = Future()
        with self._lock:
            self._between.append((fn, done))
        self._wake.set()
        done.result(timeout_s)

    def _run_between_steps(self) -> None:
        with self._lock:
            calls, self._between = list(self._between), deque()
        for fn, done in calls:
            try:
                fn()
            except Exception as e:  # the caller gets it; the loop goes on
                done.set_exception(e)
            else:
                done.set_result(None)

    def _hand_over(self) -> None:
        self._run_between_steps()
        with self._lock:
            incoming, self._incoming = list(self._incoming), deque()
            aborts, self._aborts = list(self._aborts), deque()
            ops, self._lora_ops = list(self._lora_ops), deque()
        for name, _ in ops:
            self._unload_lora(name)
        for req in incoming:
            self._engine_submit(req)
        for rid in aborts:
            if rid in self._live:
                self._engine_abort(rid)
                self._emit(rid, [], "abort")

    # ---- outputs and timelines (called by the engine half) ----------------------------------
    def _emit(self, request_id: str, new_tokens: Sequence[int], finish_reason: str | None,
              text: str | None = None) -> None:
        req = self._live.get(request_id)
        if req is None:
            return  # aborted meanwhile
        now = self._clock()
        req.tokens.extend(new_tokens)
        req.times.extend([now] * len(new_tokens))
        self.request_counters.tokens(len(new_tokens))
        if finish_reason is not None:
            req.finish_reason = finish_reason
            if text is None and self._tokenizer is not None:
                text = self._tokenizer.decode(req.tokens, skip_special_tokens=True)
            req.text = text
        if req.callback is not None:
            req.callback(req.output())
        if req.finished:
            out = req.output()  # built once, not per token: nobody reads it before
            self.request_counters.finished(out)
            with self._lock:
                del self._live[request_id]
                if req.callback is None:
                    self._finished[request_id] = out

    def subscribe_steps(self, listener: StepListener) -> None:
        """``listener`` receives a :class:`StepRecord` for every executed step."""
        self._step_listeners.append(listener)

    def unsubscribe_steps(self, listener: StepListener) -> None:
        self._step_listeners.remove(listener)

    def _record(self, shape: StepShape, seconds: float, ft_tokens: int, aborted: bool,
                span_s: float = 0.0) -> None:
        """A step ran: refit an inference-only latency model, tell the listeners. ``span_s``:
        the step's :attr:`StepRecord.span_s` where the host measures it."""
        gc_s = self._gc.take() if self._gc is not None else 0.0
        if self.coserver is None and self.latency_model is not None and not shape.is_empty:
            self.latency_model.observe(shape, seconds)
        if self._step_listeners:
            # every host plans, runs, observes, then records a step: the co-server's yield
            # before the step it last planned is this step's
            co = self.coserver
            yielded_s, hooks_s = ((co.step_yield_s, co.step_hooks_s) if isinstance(co, CoServer)
                                  else (0.0, 0.0))
            rec = StepRecord(self._clock(), shape, seconds, ft_tokens, aborted, yielded_s, hooks_s,
                             span_s, gc_s)
            for listener in self._step_listeners:
                listener(rec)

    # ---- co-serving -------------------------------------------------------------------------
    def attach(self, config: CoServeConfig, *, dataset: Dataset,
               latency_model: LatencySource = None, calibration: CalibrationConfig | None = None,
               progress: bool = True, scheduler_cls: type[AdmissionScheduler] = AdmissionScheduler,
               validation: Dataset | None = None, pool: SamplePool | None = None) -> CoServer:
        """Start co-serving under ``config``: :func:`deltaserve.train.attach.attach` (the
        arguments are its own) over this host's :meth:`training_half`, on the host's clock.
        Every host, the simulated one included, attaches through here."""
        if self._co is not None:
            raise InputError("coserver", "attached", "detach the current co-server first")
        self.check_coserve_config(config)
        co = attach(self, config, dataset=dataset, latency_model=latency_model,
                    calibration=calibration, progress=progress, scheduler_cls=scheduler_cls,
                    validation=validation, pool=pool, training=self.training_half(),
                    clock=self._clock)
        self._co, self.latency_model = co, co.latency
        return co

    def check_coserve_config(self, config: CoServeConfig) -> None:
        """Refuse, before anything heavy runs, a config this host cannot train under (an
        engine whose limits a config can exceed checks them here)."""
        del config  # by default none: the host's limits reach admission through HostLimits

    def training_half(self) -> TrainingHalf:
        """What trains this host's captured samples: the real trainer over its weights (a
        simulated host substitutes its timed stand-in)."""
        return TorchTraining(self)

    def detach(self, *, drain: bool = True, checkpoint: bool = True) -> CoServer | None:
        """Stop co-serving: train what was captured (``drain``), checkpoint, stop the backward.
        Safe while a loop runs: the host lets go of the co-server between two steps, so no step
        is using it when it closes (the loop goes on serving meanwhile)."""
        co, self._co = self._co, None
        if co is not None:
            self.call_between_steps(lambda: self.set_coserver(None))
            detach(self, co, drain=drain, checkpoint=checkpoint)
        return co

    def set_coserver(self, co: CoServingHooks | None) -> None:
        self.coserver = co

    def close(self) -> None:
        """Detach (returning captured samples, checkpointing) and release the engine."""
        self.detach(drain=False)

    # ---- the engine half --------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self._tokenizer is None:
                raise InputError("prompt", prompt[:40], "a text prompt needs a tokenizer")
            ids = list(self._tokenizer(prompt, add_special_tokens=False)["input_ids"])
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InputError("prompt", prompt, "is empty")
        if len(ids) >= self.max_model_len:
            raise InputError("prompt", f"{len(ids)} tokens",
                             f"must be shorter than max_model_len={self.max_model_len}")
        return ids

    def _check_adapter(self, name: str) -> None:
        with self._lock:
            known = name in self._adapters
        if not known:
            raise InputError("adapter", name, f"not loaded; loaded: {self.lora_names()}")

    @abstractmethod
    def _engine_submit(self, req: ClientRequest) -> None:
        """Hand a client request to the engine (between steps, on the stepping thread)."""

    @abstractmethod
    def _engine_abort(self, request_id: str) -> None:
        """Drop a request from the engine (between steps)."""

    @abstractmethod
    def _engine_step(self) -> bool:
        """One step with the co-server's hooks; ``False`` when nothing ran."""

    @abstractmethod
    def _load_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter so requests can name it (raise ``InputError`` if unusable)."""

    @abstractmethod
    def _unload_lora(self, name: str) -> None:
        """Forget a client adapter (between steps)."""
