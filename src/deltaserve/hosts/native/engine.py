"""The embedded engine: requests in, tokens out, one step at a time.

A step is schedule → (co-server plan) → run → postprocess. The client half (queues, outputs,
the loop) is :class:`deltaserve.hosts.base.BaseHost`; this module is the engine half and the
co-server's side of the contract.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from deltaserve.core.calibration import Batching, CalibrationConfig, HostLimits
from deltaserve.core.calibration_loop import run_calibration
from deltaserve.core.contract import StepReport, TrainingStep, plan_after_yield
from deltaserve.core.latency_model import LatencyModel, LatencyModelConfig
from deltaserve.core.tokenizer import Tokenizer
from deltaserve.hosts.base import BaseHost, ClientRequest
from deltaserve.hosts.native.adapters import AdapterRegistry
from deltaserve.hosts.native.attention import KVCache
from deltaserve.hosts.native.block_manager import BlockManager
from deltaserve.hosts.native.calibrate import NativeProber
from deltaserve.hosts.native.config import EngineConfig
from deltaserve.hosts.native.cuda_graphs import DecodeGraphs, buckets_up_to
from deltaserve.hosts.native.model_runner import ModelRunner, StepResult
from deltaserve.hosts.native.request import Request
from deltaserve.hosts.native.sampler import Sampler
from deltaserve.hosts.native.scheduler import ScheduledBatch, Scheduler
from deltaserve.hosts.native.stopping import finish_reason
from deltaserve.hosts.native.view import scheduling_view, step_shape
from deltaserve.model.config import ModelConfig
from deltaserve.model.llama import BaseWeights, LlamaModel
from deltaserve.model.loading import load_tokenizer, load_weights, resolve_dtype, resolve_model
from deltaserve.model.lora import AdapterWeights, LoRAConfig
from deltaserve.model.lora_slots import AdapterSlots


class LLMEngine(BaseHost):
    config_cls = EngineConfig

    def __init__(self, config: EngineConfig | None = None, *, model: LlamaModel | None = None,
                 tokenizer: Tokenizer | None = None, model_path: str | None = None):
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if model is None:
            path = resolve_model(config.model)
            model = LlamaModel(*load_weights(path, resolve_dtype(config.dtype, config.device),
                                             config.device, seed=config.seed))
            model_path = str(path)
            if tokenizer is None and (path / "tokenizer_config.json").is_file():
                tokenizer = load_tokenizer(path)
        self.model = model
        self._model_path = model_path or config.model
        mc = model.config
        super().__init__(tokenizer, config.model_len(mc.max_position_embeddings))
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.cache = KVCache(mc, config.num_blocks, config.block_size, model.weights.dtype,
                             model.weights.device)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        self.sampler = Sampler(config.seed)
        self.adapters = AdapterRegistry(mc)
        self.runner = ModelRunner(model, self.cache, self.blocks, self.adapters, self.sampler)
        if config.cuda_graphs and model.weights.device.type == "cuda":
            self.runner.graphs = self.decode_graphs(capture=True)
            self.runner.graphs.capture_all()
        self.eos_token_ids = self._eos_ids()
        self._requests: dict[str, Request] = {}

    def decode_graphs(self, capture: bool) -> DecodeGraphs:
        """Static decode buffers for this engine (a KV block reserved for padding rows), with
        adapter slots as configured; ``capture=False``: the static path run eagerly (CPU)."""
        c, weights = self.config, self.model.weights
        slots = AdapterSlots(self.model.config, num_slots=c.graph_lora_slots,
                             max_rank=c.graph_lora_rank, modules=c.graph_lora_modules,
                             dtype=weights.dtype, device=weights.device
                             ) if c.graph_lora_slots else None
        return DecodeGraphs(self.model, self.cache, batch_sizes=buckets_up_to(c.max_num_seqs),
                            max_blocks=-(-self.max_model_len // c.block_size),
                            scratch_block=self.blocks.reserve_block(), capture=capture,
                            adapter_slots=slots)

    # ---- the co-server's side (TrainingHost) ------------------------------------------------
    @property
    def limits(self) -> HostLimits:
        c = self.config
        return HostLimits(c.max_num_batched_tokens, c.max_num_seqs, self.max_model_len,
                          c.kv_cache_tokens, Batching.MIXED)

    @property
    def model_path(self) -> str:
        return self._model_path

    @property
    def model_config(self) -> ModelConfig:
        return self.model.config

    def backward_weights(self) -> BaseWeights:
        return self.model.weights  # shared memory on CPU, CUDA IPC on a GPU: no copy

    def training_dropout(self, lora: LoRAConfig) -> float:
        return lora.dropout  # the engine's LoRA applies the co-server's seeded masks

    def install_training_adapter(self, adapter: AdapterWeights) -> None:
        self.runner.train_adapter = adapter  # not in the registry: no client can name it

    def publish_adapter(self, adapter: AdapterWeights) -> None:
        """Eager steps read the adapter the backward publishes into; a graph slot holding it
        takes a copy (the co-server publishes from the stepping thread, between steps)."""
        self.runner.publish_adapter(adapter)

    def calibrate(self, lora: LoRAConfig, calibration: CalibrationConfig | None,
                  latency: LatencyModelConfig | None, *, seed: int = 0,
                  progress: bool = True) -> LatencyModel:
        return run_calibration(NativeProber(self, lora, seed=seed), calibration, latency,
                               progress=progress)

    # ---- the engine half --------------------------------------------------------------------
    def _engine_submit(self, req: ClientRequest) -> None:
        r = Request(req.request_id, list(req.prompt), req.params, req.adapter, req.arrival_s)
        self._requests[r.request_id] = r
        self.scheduler.add(r)

    def _engine_abort(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req)
            self.sampler.forget(request_id)

    def _load_lora(self, name: str, path: str) -> None:
        self.adapters.add(name, path)

    def _unload_lora(self, name: str) -> None:
        if name in self.adapters:
            self.runner.release_adapter(self.adapters.get(name))
        self.adapters.remove(name)

    def _engine_step(self) -> bool:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        mode = self.runner.mode_for(batch)
        co = self.coserver
        if co is None:
            if batch.is_empty:
                return False
            result, seconds = self._timed_run(batch, None)
            self._record(step_shape(batch, mode), seconds, 0, False, time.perf_counter() - t0)
            self._postprocess(batch, result)
            return True
        view = scheduling_view(batch, self.scheduler, time.monotonic(), mode)
        step = plan_after_yield(co, view, self._wake, time.monotonic)
        if batch.is_empty and not step.rows.num_samples:
            co.observe(StepReport(step, step.plan.shape, 0.0))  # nothing ran
            return False
        result, seconds = self._timed_run(batch, step)
        shape = step.plan.shape if step.rows.num_samples else step_shape(batch, result.mode)
        co.observe(StepReport(step, shape, seconds, result.aborted, result.layers_run))
        self._record(shape, seconds, step.rows.num_tokens, result.aborted,
                     time.perf_counter() - t0)
        self._postprocess(batch, result)
        return True

    def _timed_run(self, batch: ScheduledBatch, training: TrainingStep | None
                   ) -> tuple[StepResult, float]:
        t0 = time.perf_counter()
        result = self.runner.run(batch, training)
        return result, time.perf_counter() - t0

    def _postprocess(self, batch: ScheduledBatch, result: StepResult) -> None:
        if result.aborted:
            return
        now = time.monotonic()
        for item in batch.items:
            req = item.request
            req.num_computed += item.num_tokens
            token = result.sampled.get(req.request_id)
            if token is None:
                continue
            req.output_token_ids.append(token)
            req.token_times_s.append(now)
            reason, text = finish_reason(req, token, self.eos_token_ids, self.max_model_len,
                                         self.tokenizer)
            if reason is not None:
                self.scheduler.finish(req)
                self.sampler.forget(req.request_id)
                del self._requests[req.request_id]
            self._emit(req.request_id, [token], reason, text)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        tok = self.tokenizer
        if tok is not None and getattr(tok, "eos_token_id", None) is not None:
            ids.add(int(tok.eos_token_id))
        gen = Path(self._model_path) / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        return ids
