"""``VLLMHost``: an in-process ``vllm.LLM`` driven one ``llm_engine.step()`` at a time, with the
interface the benchmark replay uses (:class:`deltaserve.bench.host.ServingHost`).

The engine core, its scheduler (:class:`CoServingScheduler`) and its one worker (with
:class:`CoServingWorkerExtension`) run in this process; vLLM's in-process engine is not
thread-safe, so clients' :meth:`VLLMHost.add_request` only queues, and the thread running
:meth:`VLLMHost.run_loop` hands requests to vLLM between steps. An arrival still reaches the
co-server at once (``on_arrival``), so a running training-only step stops at its next layer.
"""

from __future__ import annotations

import itertools
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from deltaserve.core.calibration import HostLimits
from deltaserve.core.contract import StepRecord
from deltaserve.core.errors import InputError
from deltaserve.core.requests import RequestOutput, SamplingParams, TokenCallback
from deltaserve.core.shape import ExecMode, StepShape
from deltaserve.hosts.vllm import registry
from deltaserve.hosts.vllm.config import VLLMHostConfig, engine_limits, start_llm
from deltaserve.hosts.vllm.version import import_vllm


@dataclass
class _Live:
    """A client request the host tracks until vLLM reports it finished."""

    request_id: str
    prompt: tuple[int, ...]
    callback: TokenCallback | None
    arrival_s: float  # time.monotonic(), like the embedded engine
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    def output(self, finished: bool, reason: str | None) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, tuple(self.tokens),
                             "".join(self.text), finished, reason, self.arrival_s,
                             self.times[0] if self.times else None, tuple(self.times))


def _finish_reason(comp: Any) -> str | None:
    if comp.finish_reason == "stop":
        return "eos" if comp.stop_reason is None else "stop"
    return comp.finish_reason


class VLLMHost:
    """See the module docstring. ``llm``: an existing ``vllm.LLM`` started with
    :func:`engine_kwargs` (otherwise one is started from ``config``)."""

    def __init__(self, config: VLLMHostConfig | None = None, *, llm: Any = None):
        from deltaserve.model.loading import load_tokenizer, read_config, resolve_model

        vllm = import_vllm()
        self.config = config = config or VLLMHostConfig()
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op and drops torch to one
        # thread for the whole process; close() gives the process its threads back
        self._torch_threads = (torch.set_num_threads, torch.get_num_threads())
        if llm is None:
            path = resolve_model(config.model)
            if config.num_threads is not None:
                # vLLM keeps the torch thread count when OMP_NUM_THREADS is set; its CPU worker
                # disables torch.set_num_threads once started, so set both before it starts
                os.environ["OMP_NUM_THREADS"] = str(config.num_threads)
                torch.set_num_threads(config.num_threads)
            llm = start_llm(vllm, str(path), config)
        self.llm = llm
        self.engine = llm.llm_engine
        self.vllm_config = self.engine.vllm_config
        link = registry.find_link(self.vllm_config)
        if link is None or link.scheduler is None:
            raise InputError("llm", type(llm).__name__, "was not started with DeltaServe's "
                             "scheduler: pass **deltaserve.hosts.vllm.engine_kwargs() to vllm.LLM")
        self.link = link
        link.host = self
        self.scheduler = link.scheduler
        self.info = llm.collective_rpc("deltaserve_install", kwargs=dict(
            capture=config.capture, interrupt=config.interrupt))[0]
        mc = self.vllm_config.model_config
        self.model_path = str(mc.model)
        self.dtype = mc.dtype
        self.model_config = read_config(resolve_model(self.model_path))
        self.tokenizer = load_tokenizer(self.model_path)
        self._incoming: deque[tuple[_Live, list[int], Any, Any, float]] = deque()
        self._live: dict[str, _Live] = {}
        self._finished: dict[str, RequestOutput] = {}
        self._adapters: dict[str, Any] = {}
        self._lora_ids = itertools.count(1)
        self._req_ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.num_finished = 0  # client requests vLLM reported finished
        self.unknown_outputs = 0  # outputs for ids no client sent (must stay 0)

    # ---- facts the co-server and the replay ask for -------------------------------------------
    @property
    def limits(self) -> HostLimits:
        return engine_limits(self.vllm_config, self.scheduler)

    def execution_mode(self, shape: StepShape) -> ExecMode:
        from deltaserve.hosts.vllm.view import predict_mode

        return predict_mode(self.vllm_config, shape)

    @property
    def coserver(self) -> Any:
        return self.link.coserver

    @property
    def latency_model(self) -> Any:
        return self.link.latency_model

    @latency_model.setter
    def latency_model(self, model: Any) -> None:
        self.link.latency_model = model

    @property
    def record_steps(self) -> bool:
        return self.link.record_steps

    @record_steps.setter
    def record_steps(self, on: bool) -> None:
        self.link.record_steps = on

    @property
    def step_log(self) -> list[StepRecord]:
        return self.link.step_log

    @property
    def vllm_model(self) -> Any:
        """vLLM's model object (in this process)."""
        return self.link.worker.model_runner.model

    def decoder_layers(self) -> list[Any]:
        from deltaserve.hosts.vllm.hooks import decoder_layers

        return decoder_layers(self.vllm_model)

    def base_weights(self) -> Any:
        """The backward's base weights: views of vLLM's (GPU) or a reload (CPU); see
        :mod:`deltaserve.hosts.vllm.weights`."""
        from deltaserve.hosts.vllm.weights import backward_weights

        return backward_weights(self.vllm_model, self.model_path, self.dtype)[1]

    def publish_adapter(self, lora_state: Any) -> None:
        """Write :class:`AdapterWeights` into the reserved training adapter's slot."""
        if self.link.publisher is None:
            raise RuntimeError("no training adapter is reserved: attach first")
        self.link.publisher.publish(lora_state)

    def reserve_training_adapter(self, lora: Any, seed: int = 0) -> int:
        """Load PEFT's initial weights for ``lora`` (a :class:`LoRAConfig`) into vLLM as the
        reserved training adapter, pinned to a slot; returns the slot."""
        from deltaserve.hosts.vllm.coserve import (
            TRAIN_ADAPTER_ID,
            TRAIN_ADAPTER_NAME,
            check_lora_fits,
            write_standin_adapter,
        )

        check_lora_fits(lora, self.vllm_config)
        path = write_standin_adapter(self.model_config, lora, seed, self.model_path)
        try:
            return self.llm.collective_rpc("deltaserve_reserve_adapter",
                                           args=(TRAIN_ADAPTER_NAME, TRAIN_ADAPTER_ID, path))[0]
        finally:  # loaded (and pinned: never reloaded from disk); only its name is kept
            shutil.rmtree(path, ignore_errors=True)

    # ---- clients ----------------------------------------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at ``path`` as ``name`` (requests pick it by name)."""
        from vllm.lora.request import LoRARequest

        req = LoRARequest(name, next(self._lora_ids), str(path))
        with self._lock:
            self._adapters[name] = req

    def lora_request(self, name: str) -> Any:
        try:
            return self._adapters[name]
        except KeyError:
            raise InputError("adapter", name, f"not loaded; loaded: {sorted(self._adapters)}"
                             ) from None

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    adapter: str | None = None, callback: TokenCallback | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InputError("prompt", prompt, "is empty")
        if len(ids) >= self.vllm_config.model_config.max_model_len:
            raise InputError("prompt", f"{len(ids)} tokens", "must be shorter than "
                             f"max_model_len={self.vllm_config.model_config.max_model_len}")
        lora = self.lora_request(adapter) if adapter is not None else None
        rid = request_id if request_id is not None else f"req-{next(self._req_ids)}"
        live = _Live(rid, tuple(ids), callback, time.monotonic())
        with self._lock:
            self._incoming.append((live, ids, _vllm_params(params), lora, time.time()))
        co = self.link.coserver
        if co is not None:
            co.on_arrival()
        self._wake.set()
        return rid

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._incoming or self._live)

    def pop_finished(self, request_id: str) -> RequestOutput:
        with self._lock:
            return self._finished.pop(request_id)

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | None = None, adapter: str | None = None
                 ) -> list[RequestOutput]:
        ids = [self.add_request(p, params, adapter=adapter) for p in prompts]
        while any(i not in self._finished for i in ids):
            self.step()
        return [self.pop_finished(i) for i in ids]

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> bool:
        """One vLLM step (clients first handed to vLLM); False when it ran nothing."""
        self._drain()
        if not self.scheduler.has_requests():
            return False
        before = self.link.steps
        for out in self.engine.step():
            self._deliver(out)
        return self.link.steps != before

    def run_loop(self, stop: threading.Event, idle_wait_s: float = 0.005) -> None:
        """Step until ``stop`` is set; with nothing to run, wait for an arrival (or, while the
        backward runs, for it to finish so its commit is published)."""
        while not stop.is_set():
            if not self.step():
                co = self.link.coserver
                if co is not None and co.backward_busy:
                    co.idle(timeout_s=idle_wait_s)
                else:
                    self._wake.wait(idle_wait_s)
                    self._wake.clear()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._incoming:
                    return
                live, ids, params, lora, arrival = self._incoming.popleft()
                self._live[live.request_id] = live
            self.engine.add_request(live.request_id, {"prompt_token_ids": ids}, params,
                                    arrival_time=arrival, lora_request=lora)

    def _deliver(self, out: Any) -> None:
        live = self._live.get(out.request_id)
        if live is None:
            self.unknown_outputs += 1
            return
        now = time.monotonic()
        comp = out.outputs[0]
        live.tokens.extend(comp.token_ids)
        live.times.extend([now] * len(comp.token_ids))
        live.text.append(comp.text)
        reason = _finish_reason(comp) if out.finished else None
        result = live.output(out.finished, reason)
        if out.finished:
            self.num_finished += 1
            with self._lock:
                del self._live[out.request_id]
                if live.callback is None:
                    self._finished[out.request_id] = result
        if live.callback is not None:
            live.callback(result)

    def close(self) -> None:
        """Detach any co-server and shut vLLM's engine core down."""
        from deltaserve.hosts.vllm.coserve import detach

        detach(self, drain=False, checkpoint=False)
        self.llm.collective_rpc("deltaserve_uninstall")
        self.engine.engine_core.shutdown()
        set_threads, threads = self._torch_threads
        torch.set_num_threads = set_threads
        set_threads(threads)


def _vllm_params(p: SamplingParams) -> Any:
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VSamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                           seed=p.seed, stop=list(p.stop) or None,
                           stop_token_ids=list(p.stop_token_ids) or None,
                           ignore_eos=p.ignore_eos, output_kind=RequestOutputKind.DELTA)
