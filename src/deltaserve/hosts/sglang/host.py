"""``SGLangHost``: an unmodified SGLang in this process, as a DeltaServe host.

The client half is :class:`~deltaserve.hosts.base.BaseHost`. The engine half hands client
requests to SGLang's scheduler the way its tokenizer manager does
(``TokenizedGenerateReqInput``), steps SGLang's own event loop one iteration at a time
(:class:`~deltaserve.hosts.sglang.runtime.InProcessRuntime`) and turns SGLang's output
messages into outputs. The co-serving step protocol lives in the scheduler
(:class:`~deltaserve.hosts.sglang.scheduler.CoServingScheduler`), the co-server's side of the
contract in :class:`~deltaserve.hosts.sglang.training.SchedulerTrainingHost`, which this class
delegates to.
"""

from __future__ import annotations

import threading
from array import array

import torch
from sglang.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from sglang.srt.sampling.sampling_params import SamplingParams as SGLangParams

from deltaserve.core.calibration import CalibrationConfig
from deltaserve.core.contract import CoServingHooks
from deltaserve.core.latency_model import LatencyModel, LatencyModelConfig
from deltaserve.core.requests import SamplingParams
from deltaserve.hosts.base import BaseHost, ClientRequest
from deltaserve.hosts.delegated import DelegatedTraining
from deltaserve.hosts.sglang.config import SGLangConfig
from deltaserve.hosts.sglang.runtime import InProcessRuntime, Output
from deltaserve.hosts.sglang.training import SchedulerTrainingHost
from deltaserve.model.loading import load_tokenizer, read_config, resolve_dtype, resolve_model
from deltaserve.model.lora import LoRAConfig
from deltaserve.model.peft_io import read_lora_config


def _reason(finish: dict, params: SamplingParams | None) -> str:
    """SGLang's finish reason as DeltaServe's: ``length``, ``stop``, ``eos`` or ``abort``
    (a matched token id that is not one of the request's stop tokens is the model's EOS)."""
    kind, matched = finish.get("type"), finish.get("matched")
    if kind == "stop":
        stop_ids = params.stop_token_ids if params is not None else ()
        return "eos" if isinstance(matched, int) and matched not in stop_ids else "stop"
    return "length" if kind == "length" else "abort"


class SGLangHost(DelegatedTraining, BaseHost):
    config_cls = SGLangConfig
    training: SchedulerTrainingHost

    def __init__(self, config: SGLangConfig | None = None):
        self.config = config = config or SGLangConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        path = resolve_model(config.model)
        model_config = read_config(path)
        model_len = config.model_len(model_config.max_position_embeddings)
        super().__init__(load_tokenizer(path), model_len)
        dtype = str(resolve_dtype(config.dtype, "cpu")).removeprefix("torch.")
        self.runtime = InProcessRuntime(config.server_args(str(path), dtype, model_len))
        self.scheduler = self.runtime.scheduler
        self.training = SchedulerTrainingHost(self.scheduler, path, model_config,
                                              self.tokenizer, self.scheduler.deltaserve_limits())
        self.scheduler.deltaserve_listener = self._record
        self.scheduler.deltaserve_wake = self._wake  # an arrival ends a yield early
        self._lora_ids: dict[str, str] = {}
        self._lora_lock = threading.Lock()
        self._pending_loads: list[tuple[str, str]] = []
        self._rids: dict[str, str] = {}  # SGLang's id → the client's

    # ---- the co-server's side (TrainingHost; the rest is DelegatedTraining) ---------------
    def calibrate(self, lora: LoRAConfig, calibration: CalibrationConfig | None,
                  latency: LatencyModelConfig | None, *, seed: int = 0,
                  progress: bool = True) -> LatencyModel:
        return self.training.calibrate(lora, calibration, latency, seed=seed, progress=progress)

    def set_coserver(self, co: CoServingHooks | None) -> None:
        super().set_coserver(co)
        self.training.set_coserver(co)

    # ---- the engine half --------------------------------------------------------------------
    def _engine_submit(self, req: ClientRequest) -> None:
        self._flush_loads()
        rid = f"{req.request_id}."  # "." ends it: SGLang aborts by id prefix
        self._rids[rid] = req.request_id
        self.scheduler.deltaserve_submit(TokenizedGenerateReqInput(
            rid=rid, input_text=None, input_ids=array("q", req.prompt), input_embeds=None,
            mm_inputs=None, token_type_ids=None, sampling_params=self._params(req.params),
            return_logprob=False, logprob_start_len=-1, top_logprobs_num=0,
            token_ids_logprob=None, stream=True,
            lora_id=self._lora_ids[req.adapter] if req.adapter else None), req.arrival_s)

    def _params(self, p: SamplingParams) -> SGLangParams:
        params = SGLangParams(max_new_tokens=p.max_tokens, temperature=p.temperature,
                              top_p=p.top_p, sampling_seed=p.seed, stop=list(p.stop) or None,
                              stop_token_ids=list(p.stop_token_ids) or None,
                              ignore_eos=p.ignore_eos)
        params.normalize(self.scheduler.tokenizer)
        params.verify(self.scheduler.model_config.vocab_size)
        return params

    def _engine_abort(self, request_id: str) -> None:
        rid = f"{request_id}."
        self._rids.pop(rid, None)
        self.scheduler.abort_request(AbortReq(rid=rid))

    def _engine_step(self) -> bool:
        ran = self.runtime.step()
        self._deliver(self.runtime.drain())
        return ran

    def _deliver(self, outputs: list[Output]) -> None:
        for out in outputs:
            request_id = self._rids.get(out.rid)
            if request_id is None:
                continue  # aborted meanwhile
            reason, text = None, None
            if out.finish_reason is not None:
                del self._rids[out.rid]
                req = self._live.get(request_id)
                reason = _reason(out.finish_reason, req.params if req else None)
                text = self._stop_text(request_id, out, out.finish_reason)
            self._emit(request_id, out.new_token_ids, reason, text)

    def _stop_text(self, request_id: str, out: Output, finish: dict) -> str | None:
        """The text of a request stopped by a stop string: up to the string, excluded."""
        matched, tok = finish.get("matched"), self.tokenizer
        req = self._live.get(request_id)
        if not isinstance(matched, str) or tok is None or req is None:
            return None
        text = tok.decode([*req.tokens, *out.new_token_ids], skip_special_tokens=True)
        return text.split(matched, 1)[0]

    # ---- client adapters --------------------------------------------------------------------
    def _load_lora(self, name: str, path: str) -> None:
        """Checked now (so errors reach the caller); loaded by the stepping thread."""
        self.training.check_adapter(read_lora_config(path), "adapter")
        with self._lora_lock:
            self._pending_loads.append((name, path))

    def _flush_loads(self) -> None:
        with self._lora_lock:
            loads, self._pending_loads = self._pending_loads, []
        for name, path in loads:
            if name in self._lora_ids:
                self._unload_lora(name)
            self._lora_ids[name] = self.training.load(name, path)

    def _unload_lora(self, name: str) -> None:
        self._flush_loads()
        lora_id = self._lora_ids.pop(name, None)
        if lora_id is not None:
            self.training.unload(name, lora_id)

    def close(self) -> None:
        """Detach (checkpointing), then tear SGLang down (one SGLang host per process)."""
        try:
            super().close()
        finally:
            self.training.close()
            self.runtime.close()

    def __enter__(self) -> SGLangHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
