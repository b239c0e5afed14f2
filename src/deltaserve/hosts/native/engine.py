"""The engine: requests in, tokens out, one ``step()`` at a time.

``step()`` = schedule → (co-server plan) → run → postprocess. Clients may call
:meth:`LLMEngine.add_request` from any thread while another thread drives :meth:`run_loop`.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import torch

from deltaserve.core.calibration import Batching, HostLimits
from deltaserve.core.contract import StepRecord, StepReport
from deltaserve.core.errors import InputError
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.shape import ExecMode, StepShape
from deltaserve.hosts.native.adapters import AdapterRegistry
from deltaserve.hosts.native.attention import KVCache
from deltaserve.hosts.native.block_manager import BlockManager
from deltaserve.hosts.native.config import EngineConfig
from deltaserve.hosts.native.cuda_graphs import DecodeGraphs, buckets_up_to
from deltaserve.hosts.native.model_runner import ModelRunner, StepResult, TrainingRows
from deltaserve.hosts.native.request import (
    Request,
    RequestOutput,
    SamplingParams,
    Status,
    TokenCallback,
)
from deltaserve.hosts.native.sampler import Sampler
from deltaserve.hosts.native.scheduler import ScheduledBatch, Scheduler
from deltaserve.hosts.native.view import scheduling_view, step_shape
from deltaserve.model.llama import LlamaModel
from deltaserve.model.loading import (
    load_tokenizer,
    load_weights,
    resolve_dtype,
    resolve_model,
)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, model: LlamaModel | None = None,
                 tokenizer=None, model_path: str | None = None):
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if model is None:
            path = resolve_model(config.model)
            model = LlamaModel(*load_weights(path, resolve_dtype(config.dtype, config.device),
                                             config.device))
            model_path = str(path)
            if tokenizer is None and (path / "tokenizer_config.json").is_file():
                tokenizer = load_tokenizer(path)
        self.model = model
        self.model_path = model_path or config.model
        self.tokenizer = tokenizer
        mc = model.config
        self.max_model_len = min(config.max_model_len or min(mc.max_position_embeddings, 4096),
                                 config.kv_cache_tokens)
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.cache = KVCache(mc, config.num_blocks, config.block_size, model.weights.dtype,
                             model.weights.device)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        self.sampler = Sampler(config.seed)
        self.adapters = AdapterRegistry(mc)
        self.runner = ModelRunner(model, self.cache, self.blocks, self.adapters, self.sampler)
        if config.cuda_graphs and model.weights.device.type == "cuda":
            self.runner.graphs = DecodeGraphs(
                model, self.cache, batch_sizes=buckets_up_to(config.max_num_seqs),
                max_blocks=-(-self.max_model_len // config.block_size),
                scratch_block=self.blocks.reserve_block(), capture=True)
            self.runner.graphs.capture_all()
        self.eos_token_ids = self._eos_ids()
        self.coserver = None  # a deltaserve.train.coserver.CoServer once attached
        self.latency_model: LatencyModel | None = None
        self.step_log: list[StepRecord] = []
        self.record_steps = False
        self._incoming: deque[Request] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._requests: dict[str, Request] = {}

    # ---- facts the co-server asks for -------------------------------------------------------
    @property
    def limits(self) -> HostLimits:
        c = self.config
        return HostLimits(c.max_num_batched_tokens, c.max_num_seqs, self.max_model_len,
                          c.kv_cache_tokens, Batching.MIXED)

    def execution_mode(self, shape: StepShape) -> ExecMode:
        """Graph for a decode-only step a captured bucket holds (assuming base-model requests:
        the shape does not say which rows carry adapters; the step reports what it ran)."""
        g = self.runner.graphs
        if g is None or not shape.is_decode_only or shape.ft_lens or not shape.num_decode:
            return ExecMode.EAGER
        longest = -(-shape.kv_tokens // shape.num_decode) + 1  # the mean context, at least
        return ExecMode.EAGER if g.bucket(shape.num_decode, longest) is None else ExecMode.GRAPH

    # ---- clients ----------------------------------------------------------------------------
    def add_lora(self, name: str, adapter) -> None:
        self.adapters.add(name, adapter)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    adapter: str | None = None, callback: TokenCallback | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError("prompt", prompt[:40], "a text prompt needs a tokenizer")
            ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InputError("prompt", prompt, "is empty")
        if len(ids) >= self.max_model_len:
            raise InputError("prompt", f"{len(ids)} tokens",
                             f"must be shorter than max_model_len={self.max_model_len}")
        if params.stop and self.tokenizer is None:
            raise InputError("stop", params.stop, "stop strings need a tokenizer")
        if adapter is not None:
            self.adapters.get(adapter)  # raises with the loaded names
        req = Request(ids, params, adapter, callback, arrival_s=time.monotonic())
        if request_id is not None:
            req.request_id = request_id
        with self._lock:
            self._incoming.append(req)
            self._requests[req.request_id] = req
        if self.coserver is not None:
            self.coserver.on_arrival()
        self._wake.set()
        return req.request_id

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._incoming) or self.scheduler.has_work()

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | None = None, adapter: str | None = None
                 ) -> list[RequestOutput]:
        ids = [self.add_request(p, params, adapter=adapter) for p in prompts]
        while any(self._requests[i].status is not Status.FINISHED for i in ids):
            self.step()
        return [self._requests.pop(i).output() for i in ids]

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one step; ``False`` when there was nothing to run."""
        with self._lock:
            self._wake.clear()  # arrivals from here on wake a yield early
            while self._incoming:
                self.scheduler.add(self._incoming.popleft())
        batch = self.scheduler.schedule()
        co = self.coserver
        now = time.monotonic()
        mode = self.runner.mode_for(batch)
        if co is None:
            if batch.is_empty:
                return False
            shape = step_shape(batch, mode)
            result, seconds = self._timed_run(batch, None)
            if self.latency_model is not None:
                self.latency_model.observe(shape, seconds)
            self._record(shape, seconds, 0, False)
            self._postprocess(batch, result)
            return True

        view = scheduling_view(batch, self.scheduler, now, mode)
        if not batch.is_empty:
            pause = co.yield_budget_s(view)
            if pause > 0:  # the SLOs have room: the backward gets the machine first
                co.yield_to_backward(pause, self._wake)
                view = scheduling_view(batch, self.scheduler, time.monotonic(), mode)
        plan = co.plan(view)
        if batch.is_empty and not plan.samples:
            return False
        training = None
        if plan.samples:
            training = TrainingRows(
                co.training_tokens(plan), lambda rows: co.training_lora(plan, rows),
                co.capture, co.capture_mlp if co.buffer.config.saves_mlp else None,
                co.should_abort)
        co.begin_step(plan)
        result, seconds = self._timed_run(batch, training)
        co.observe(StepReport(plan, plan.shape, seconds, result.aborted, result.layers_run))
        self._record(plan.shape, seconds, plan.num_ft_tokens, result.aborted)
        self._postprocess(batch, result)
        return True

    def _timed_run(self, batch: ScheduledBatch, training: TrainingRows | None
                   ) -> tuple[StepResult, float]:
        t0 = time.perf_counter()
        result = self.runner.run(batch, training)
        return result, time.perf_counter() - t0

    def _record(self, shape: StepShape, seconds: float, ft_tokens: int, aborted: bool) -> None:
        if self.record_steps:
            self.step_log.append(StepRecord(time.monotonic(), shape, seconds, ft_tokens, aborted))

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
            self._check_stop(req, token)
            if req.status is Status.FINISHED:
                self.sampler.forget(req.request_id)
            if req.callback is not None:
                req.callback(req.output())

    def _check_stop(self, req: Request, token: int) -> None:
        p, tok = req.params, self.tokenizer
        reason = None
        if not p.ignore_eos and token in self.eos_token_ids:
            reason = "eos"
        elif token in p.stop_token_ids:
            reason = "stop"
        elif p.stop:  # stop strings: decode what we have and look for them
            text = tok.decode(req.output_token_ids, skip_special_tokens=True)
            for s in p.stop:
                cut = text.find(s)
                if cut >= 0:
                    req.text, reason = text[:cut], "stop"
                    break
        if reason is None and (len(req.output_token_ids) >= p.max_tokens
                               or req.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is None:
            return
        if req.text is None and tok is not None:
            req.text = tok.decode(req.output_token_ids, skip_special_tokens=True)
        req.finish_reason = reason
        self.scheduler.finish(req)

    # ---- serving loop -----------------------------------------------------------------------
    def run_loop(self, stop: threading.Event, idle_wait_s: float = 0.005) -> None:
        """Step until ``stop`` is set; between steps with nothing to run, wait for an arrival
        (or, when co-serving, for the backward to free the buffer)."""
        while not stop.is_set():
            if not self.step():
                if self.coserver is not None and self.coserver.backward_busy:
                    self.coserver.idle(timeout_s=idle_wait_s)
                else:
                    self._wake.wait(idle_wait_s)
                    self._wake.clear()

    def pop_finished(self, request_id: str) -> RequestOutput:
        with self._lock:
            return self._requests.pop(request_id).output()

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen = Path(self.model_path) / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        return ids
