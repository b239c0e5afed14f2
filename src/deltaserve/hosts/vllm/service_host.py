"""The fine-tuning service's view of vLLM, from inside vLLM's API-server process.

vLLM's OpenAI server keeps the engine in a process of its own; the co-server lives there
(:class:`~deltaserve.hosts.vllm.remote.RemoteCoServing`). This module is the API-server half:

* :class:`EngineCalls`: the worker extension's RPCs (``collective_rpc``, vLLM's documented way
  to reach an engine-side method) as blocking calls from the service's own threads;
* :class:`EngineJobs` / :class:`RemoteJob`: attach and detach one job's co-server in the engine
  process, its training events delivered to listeners by a poller thread in the order the
  co-server emitted them (what :class:`~deltaserve.server.coserving_runner.CoServingRunner`
  expects of a host and its co-server);
* :class:`VLLMBackend`: trained adapters served by name through vLLM's runtime LoRA loading
  (``OpenAIServingModels.load_lora_adapter``, what ``/v1/load_lora_adapter`` calls; that route
  itself stays off unless ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set, so clients cannot load
  adapters of their own). Inference requests are vLLM's server's own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client.registry import Collector
from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from vllm.v1.metrics.prometheus import get_prometheus_registry

from deltaserve.core.config_io import JSONValue, from_dict, to_dict
from deltaserve.core.data import TrainingSample
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.requests import SamplingParams, TokenCallback
from deltaserve.core.tokenizer import Tokenizer
from deltaserve.hosts.vllm.wire import JobPoll, JobStart, RemoteStatus, decode_event
from deltaserve.train.config import CoServeConfig
from deltaserve.train.events import CoServeStats, Listener

log = logging.getLogger("deltaserve.vllm")
JSON = dict[str, JSONValue]
RPC_TIMEOUT_S = 900.0  # a job's start spawns the backward process; a drain trains what is left
POLL_INTERVAL_S = 0.2  # how often a job's events are fetched from the engine process


class EngineCalls:
    """The worker extension's ``deltaserve_*`` RPCs. ``client``: vLLM's ``EngineClient``
    (untyped here: vLLM's object), ``loop``: the server's event loop it belongs to."""

    def __init__(self, client: Any, loop: asyncio.AbstractEventLoop):
        self.client = client
        self.loop = loop

    async def call_async(self, method: str, *args: JSONValue) -> JSON:
        return (await self.client.collective_rpc(method, args=args))[0]

    def __call__(self, method: str, *args: JSONValue) -> JSON:
        """From any thread but the loop's: blocks until the engine answered."""
        future = asyncio.run_coroutine_threadsafe(self.call_async(method, *args), self.loop)
        return future.result(RPC_TIMEOUT_S)


class RemoteJob:
    """One job's co-server in the engine process: its listeners and last known counters.
    Events that arrive before the first listener subscribes are held for it."""

    def __init__(self, stats: CoServeStats):
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._held: list[JobPoll] = []
        self._stats = stats

    def subscribe(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)
            held, self._held = self._held, []
        for poll in held:
            self.deliver(poll)

    def stats(self) -> CoServeStats:
        return self._stats

    def deliver(self, poll: JobPoll) -> None:
        """Called by one thread at a time (the poller, then the detaching thread)."""
        if poll.stats is not None:
            self._stats = poll.stats
        with self._lock:
            listeners = list(self._listeners)
            if not listeners:
                self._held.append(poll)
                return
        for wire in poll.events:
            event = decode_event(wire)
            for listener in listeners:
                listener(event)


class EngineJobs:
    """Attach/detach of one job's co-server in vLLM's engine process (one at a time)."""

    def __init__(self, calls: EngineCalls, poll_interval_s: float = POLL_INTERVAL_S):
        self.calls = calls
        self.poll_interval_s = poll_interval_s
        self._job: RemoteJob | None = None
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    def attach(self, *, dataset: Sequence[TrainingSample], config: CoServeConfig,
               latency_model: LatencyModel | None = None, progress: bool = False,
               validation: Sequence[TrainingSample] | None = None) -> RemoteJob:
        """Start the job's co-server (the engine's calibrated latency model serves it:
        ``latency_model`` and ``progress`` are the local host's knobs and unused here)."""
        del latency_model, progress
        start = JobStart(config, tuple(dataset), tuple(validation or ()))
        self.calls("deltaserve_job_start", to_dict(start))
        first = self._poll()
        assert first.stats is not None, first.status
        job = self._job = RemoteJob(first.stats)
        job.deliver(first)
        self._stop.clear()
        self._poller = threading.Thread(target=self._run, args=(job,), daemon=True,
                                        name="deltaserve-job-poller")
        self._poller.start()
        return job

    def detach(self, *, drain: bool = True, checkpoint: bool = True) -> None:
        """Stop polling, detach in the engine process; its last events reach the listeners
        before this returns."""
        job, self._job = self._job, None
        self._stop.set()
        if self._poller is not None:
            self._poller.join()
            self._poller = None
        poll = from_dict(JobPoll, self.calls("deltaserve_detach", drain, checkpoint))
        if job is not None:
            job.deliver(poll)

    def status(self) -> RemoteStatus:
        return from_dict(RemoteStatus, self.calls("deltaserve_status"))

    def _poll(self) -> JobPoll:
        return from_dict(JobPoll, self.calls("deltaserve_job_poll"))

    def _run(self, job: RemoteJob) -> None:
        while not self._stop.wait(self.poll_interval_s):
            try:
                job.deliver(self._poll())
            except Exception:  # the engine is going down, or a listener failed: keep polling
                log.exception("polling the job's co-server failed")


class VLLMBackend:
    """The service's :class:`~deltaserve.server.protocols.InferenceBackend` on vLLM's server:
    adapters by name through ``state.openai_serving_models`` (vLLM's runtime LoRA loading);
    vLLM's own routes serve inference, so :meth:`add_request` is never called here."""

    def __init__(self, serving_models: Any, loop: asyncio.AbstractEventLoop, model_name: str,
                 tokenizer: Tokenizer, max_model_len: int):
        self.serving_models = serving_models  # vLLM's OpenAIServingModels
        self.loop = loop
        self.model_name = model_name
        self.tokenizer: Tokenizer | None = tokenizer
        self.max_model_len = max_model_len

    def add_request(self, prompt: Sequence[int], params: SamplingParams, *,
                    adapter: str | None = None, callback: TokenCallback | None = None,
                    request_id: str | None = None) -> str:
        raise RuntimeError("vLLM's own OpenAI routes serve inference on this server")

    def abort_request(self, request_id: str) -> None:
        raise RuntimeError("vLLM's own OpenAI routes serve inference on this server")

    def add_lora(self, name: str, path: str) -> None:
        """Load the PEFT directory ``path`` as model ``name`` (from any thread but the loop's);
        ``RuntimeError`` with vLLM's message if it refuses."""
        request = LoadLoRAAdapterRequest(lora_name=name, lora_path=str(Path(path).resolve()))
        self._check(self.serving_models.load_lora_adapter(request))

    def remove_lora(self, name: str) -> None:
        self._check(self.serving_models.unload_lora_adapter(
            UnloadLoRAAdapterRequest(lora_name=name)))

    def lora_names(self) -> list[str]:
        return list(self.serving_models.lora_requests)

    def _check(self, coroutine: Any) -> None:
        result = asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(RPC_TIMEOUT_S)
        if not isinstance(result, str):  # vLLM's ErrorResponse
            raise RuntimeError(f"vLLM refused the adapter: {result.error.message}")


def register_metrics(collector: Collector) -> None:
    """Serve ``collector`` on vLLM's own ``/metrics`` beside vLLM's metrics (one API-server
    process: with ``PROMETHEUS_MULTIPROC_DIR`` set vLLM builds a fresh registry per scrape)."""
    get_prometheus_registry().register(collector)
