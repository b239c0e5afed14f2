"""``VLLMHost``: an in-process ``vllm.LLM`` as a DeltaServe host, driven one
``llm_engine.step()`` at a time.

The client half (queues, outputs, the loop, attach/detach) is
:class:`~deltaserve.hosts.base.BaseHost`; this module is the engine half. The engine core, its
scheduler (:class:`~.scheduler.CoServingScheduler`, which runs the co-server's step) and its one
worker (with :class:`~.worker_ext.CoServingWorkerExtension`) run in this process. vLLM's
in-process engine is not thread-safe, so client requests reach it only between steps, from the
thread that steps it (as on every host).

With vLLM's own offline API, wrap the ``vllm.LLM`` (started with :func:`engine_kwargs`)::

    host = VLLMHost(llm=llm)
    host.attach(CoServeConfig(SLOConfig(ttft_s=2.0, tpot_s=0.2)), dataset="train.jsonl")
    llm.generate(prompts, params)       # training rides in these steps
    train_while_idle(host, seconds=60)  # and in training-only steps
    host.detach()
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from vllm import LLM
from vllm.lora.request import LoRARequest
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.sampling_params import SamplingParams as VLLMSamplingParams

from deltaserve.core.calibration import CalibrationConfig
from deltaserve.core.contract import CoServingHooks
from deltaserve.core.errors import InputError, require
from deltaserve.core.latency_model import LatencyModel, LatencyModelConfig
from deltaserve.core.requests import SamplingParams
from deltaserve.hosts.base import BaseHost, ClientRequest
from deltaserve.hosts.delegated import DelegatedTraining
from deltaserve.hosts.vllm.aux_model import register_aux_capture_model
from deltaserve.hosts.vllm.config import (
    BASE_ARCHITECTURE,
    VLLMHostConfig,
    engine_kwargs,
    wants_aux_model,
)
from deltaserve.hosts.vllm.link import EngineLink, find_link
from deltaserve.hosts.vllm.scheduler import CoServingScheduler
from deltaserve.hosts.vllm.train_adapter import check_lora_fits
from deltaserve.hosts.vllm.training import EngineTraining
from deltaserve.hosts.vllm.version import import_vllm
from deltaserve.hosts.vllm.worker_ext import WorkerInfo
from deltaserve.model.loading import load_tokenizer, read_config, resolve_model
from deltaserve.model.lora import LoRAConfig
from deltaserve.model.peft_io import load_adapter
from deltaserve.train.buffer import BufferSave
from deltaserve.train.config import CoServeConfig


def start_llm(config: VLLMHostConfig) -> LLM:
    """A ``vllm.LLM`` for ``config``, plugged into DeltaServe."""
    path = resolve_model(config.model)
    if wants_aux_model(config):
        archs = json.loads((path / "config.json").read_text()).get("architectures")
        if archs != [BASE_ARCHITECTURE]:
            raise InputError("capture", "aux", f"the compile-safe capture supports "
                             f"{BASE_ARCHITECTURE} checkpoints; this model is {archs}")
        register_aux_capture_model()
    if config.num_threads is not None:
        # vLLM keeps the torch thread count when OMP_NUM_THREADS is set; its CPU worker disables
        # torch.set_num_threads once started, so set both before it starts
        os.environ["OMP_NUM_THREADS"] = str(config.num_threads)
        torch.set_num_threads(config.num_threads)
    limit = read_config(path).max_position_embeddings
    return LLM(model=str(path), **engine_kwargs(config, limit))


def vllm_params(p: SamplingParams) -> VLLMSamplingParams:
    return VLLMSamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                              seed=p.seed, stop=list(p.stop) or None,
                              stop_token_ids=list(p.stop_token_ids) or None,
                              ignore_eos=p.ignore_eos, output_kind=RequestOutputKind.DELTA)


def finish_reason(comp: CompletionOutput) -> str | None:
    """vLLM's finish reason in the contract's words (``eos`` for a plain stop at EOS)."""
    if comp.finish_reason == "stop":
        return "eos" if comp.stop_reason is None else "stop"
    return comp.finish_reason


class VLLMHost(DelegatedTraining, BaseHost):
    """See the module docstring. ``llm``: an existing ``vllm.LLM`` started with
    :func:`engine_kwargs` (otherwise one is started from ``config``)."""

    training: EngineTraining

    config_cls = VLLMHostConfig

    def __init__(self, config: VLLMHostConfig | None = None, *, llm: LLM | None = None):
        import_vllm()  # the CPU defaults and the version check before vLLM starts
        self.config = config = config or VLLMHostConfig()
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op and drops torch to one
        # thread for the whole process; close() gives the process its threads back
        self._torch_threads = (torch.set_num_threads, torch.get_num_threads())
        self.llm = llm if llm is not None else start_llm(config)
        self.engine = self.llm.llm_engine
        vc = self.engine.vllm_config
        link = find_link(vc)
        if link is None or link.scheduler is None:
            raise InputError("llm", type(self.llm).__name__, "was not started with DeltaServe's "
                             "scheduler: pass **deltaserve.hosts.vllm.engine_kwargs() to vllm.LLM")
        self.link: EngineLink = link
        self.scheduler: CoServingScheduler = link.scheduler
        self.worker_info: WorkerInfo = self.llm.collective_rpc(
            "deltaserve_install", kwargs=dict(capture=config.capture,
                                              training_lora=config.training_lora))[0]
        self.training = EngineTraining(link, vc)
        super().__init__(load_tokenizer(self.training.model_path), vc.model_config.max_model_len)
        link.on_step = self._record
        link.on_shutdown = self._engine_shutdown
        # arrivals reach this host on any thread (add_request): they end a yield early
        link.wake = self._wake
        self._loras: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)  # as vLLM's API server numbers adapters
        self._texts: dict[str, list[str]] = {}

    # ---- the co-server's side (TrainingHost; the rest is DelegatedTraining) -----------------
    def calibrate(self, lora: LoRAConfig, calibration: CalibrationConfig | None,
                  latency: LatencyModelConfig | None, *, seed: int = 0,
                  progress: bool = True) -> LatencyModel:
        """Run the calibration plan through vLLM's scheduler and forward on this idle host."""
        if self.has_unfinished():
            raise RuntimeError("calibrate an idle engine: requests are in flight")
        check_lora_fits(lora, self.engine.vllm_config)
        run = self.training.calibration_run(lora, calibration, latency, seed=seed,
                                            progress=progress)
        self.link.calibration = run
        try:
            while not run.done:
                self.step()
        finally:
            self.link.calibration = None
        assert run.model is not None
        return run.model

    def set_coserver(self, co: CoServingHooks | None) -> None:
        super().set_coserver(co)
        self.link.coserver = co

    def check_coserve_config(self, config: CoServeConfig) -> None:
        """The checks that need nothing heavy: the training adapter's rank fits vLLM's
        ``max_lora_rank``, and the buffer keeps what vLLM's hooks capture (the residual
        stream)."""
        check_lora_fits(config.lora, self.engine.vllm_config)
        require(config.backward.buffer_save is BufferSave.RESIDUAL, "buffer_save",
                config.backward.buffer_save, "the vLLM host captures the residual stream only")

    # ---- the engine half --------------------------------------------------------------------
    def _engine_submit(self, req: ClientRequest) -> None:
        lora = self._loras[req.adapter] if req.adapter is not None else None
        arrival_wall_s = time.time() - (time.monotonic() - req.arrival_s)
        self._texts[req.request_id] = []
        self.engine.add_request(req.request_id, {"prompt_token_ids": list(req.prompt)},
                                vllm_params(req.params), arrival_time=arrival_wall_s,
                                lora_request=lora)

    def _engine_abort(self, request_id: str) -> None:
        self.engine.abort_request([request_id])
        self._texts.pop(request_id, None)

    def _engine_step(self) -> bool:
        if not self.scheduler.has_requests():
            return False
        before = self.link.steps
        for out in self.engine.step():
            assert isinstance(out, RequestOutput)
            self._deliver(out)
        return self.link.steps != before

    def _deliver(self, out: RequestOutput) -> None:
        comp = out.outputs[0]
        texts = self._texts.get(out.request_id)
        if texts is None:
            return  # aborted meanwhile (hidden requests never reach the output path)
        texts.append(comp.text)
        reason = finish_reason(comp) if out.finished else None
        if reason is not None:
            del self._texts[out.request_id]
        self._emit(out.request_id, list(comp.token_ids), reason,
                   "".join(texts) if reason is not None else None)

    def _load_lora(self, name: str, path: str) -> None:
        """Validate the adapter now (the caller's thread); vLLM loads it at its first use."""
        if not Path(path).is_dir():
            raise InputError("adapter_path", path, "not a directory")
        adapter = load_adapter(path, self.training.model_config)
        check_lora_fits(adapter.config, self.engine.vllm_config)
        self._loras[name] = LoRARequest(name, next(self._lora_ids), str(path))

    def _unload_lora(self, name: str) -> None:
        lora = self._loras.pop(name, None)
        if lora is not None and lora.lora_int_id in self.engine.list_loras():
            self.engine.remove_lora(lora.lora_int_id)

    # ---- shutdown ---------------------------------------------------------------------------
    def _engine_shutdown(self) -> None:
        self.detach(drain=False)

    def close(self) -> None:
        """Detach any co-server (checkpointing) and shut vLLM's engine core down."""
        super().close()
        self.llm.collective_rpc("deltaserve_uninstall")
        self.engine.engine_core.shutdown()
        set_threads, threads = self._torch_threads
        torch.set_num_threads = set_threads
        set_threads(threads)


def train_while_idle(host: VLLMHost, seconds: float | None = None,
                     until: Callable[[], bool] | None = None) -> None:
    """Step an attached host with no client work (training-only steps, backward commits) for
    ``seconds``, until ``until()``, or until co-serving has nothing left to do; for
    ``vllm.LLM`` users, whose ``generate`` steps only while its own requests are unfinished."""
    co = host.coserver
    if co is None:
        raise InputError("coserver", None, "attach a co-server first")
    deadline = None if seconds is None else time.monotonic() + seconds
    while (deadline is None or time.monotonic() < deadline) and not (until and until()):
        if not host.step():
            if not co.wants_step():
                return
            co.idle(0.01)
