"""Start-up calibration of the embedded engine: its prober runs each probe of the plan through
the engine's real forward path (the loop around it is :mod:`deltaserve.core.calibration_loop`).

Each probe becomes a real batch: synthetic requests that own real KV blocks (their cached
context is not computed: attention costs the same whatever the cached values are), plus
training rows on a stand-in training adapter with the co-server's LoRA config and a capture
copy of the same size. One untimed warm-up run precedes the timed repeats of every probe.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from deltaserve.core.calibration import CalibrationProbe, HostLimits
from deltaserve.core.calibration_loop import ProbeTiming
from deltaserve.core.requests import SamplingParams
from deltaserve.core.shape import StepShape
from deltaserve.hosts.native.block_manager import BlockManager
from deltaserve.hosts.native.model_runner import ModelRunner
from deltaserve.hosts.native.request import Request
from deltaserve.hosts.native.sampler import Sampler
from deltaserve.hosts.native.scheduler import ScheduledBatch, ScheduledItem
from deltaserve.hosts.native.view import step_shape
from deltaserve.hosts.probe import ProbeStep, probe_step, random_rows
from deltaserve.model.llama import LlamaModel
from deltaserve.model.lora import AdapterWeights, LoRAConfig


class ProbedEngine(Protocol):
    """The parts of the embedded engine a probe runs on (the engine is one; naming them here
    instead of the engine keeps this module below ``engine.py``, which builds the prober)."""

    model: LlamaModel
    runner: ModelRunner
    blocks: BlockManager
    sampler: Sampler

    @property
    def limits(self) -> HostLimits: ...

    def has_unfinished(self) -> bool: ...


class _Probe:
    """The requests of one probe, holding KV blocks until released."""

    def __init__(self, engine: ProbedEngine, probe: CalibrationProbe, rng: random.Random):
        self.engine = engine
        vocab = engine.model.config.vocab_size
        items: list[ScheduledItem] = []
        self.requests: list[Request] = []
        for _ in range(probe.shape.num_decode):
            kv = probe.kv_per_decode
            req = Request(f"probe-{len(self.requests)}", [rng.randrange(vocab)
                                                           for _ in range(kv)], SamplingParams())
            req.output_token_ids = [rng.randrange(vocab)]
            req.num_computed = kv
            items.append(self._hold(req, kv + 1, 1))
        for n in probe.shape.prefill_lens:
            req = Request(f"probe-{len(self.requests)}",
                          [rng.randrange(vocab) for _ in range(probe.prefix_len + n)],
                          SamplingParams())
            req.num_computed = probe.prefix_len
            items.append(self._hold(req, probe.prefix_len + n, n))
        self.batch = ScheduledBatch(tuple(items))

    def _hold(self, req: Request, tokens: int, n: int) -> ScheduledItem:
        self.engine.blocks.grow(req, tokens)
        self.requests.append(req)
        return ScheduledItem(req, n)

    def release(self) -> None:
        for req in self.requests:
            self.engine.blocks.free(req)
            self.engine.sampler.forget(req.request_id)


def _probe_step(shape: StepShape, vocab: int, lora: LoRAConfig, rng: random.Random,
                scratch: torch.Tensor) -> ProbeStep | None:
    if not shape.ft_lens:
        return None
    return probe_step(random_rows(shape.ft_lens, vocab, rng), shape, lora.dropout, scratch)


def time_probe(engine: ProbedEngine, probe: CalibrationProbe, lora: LoRAConfig,
               rng: random.Random, adapter: AdapterWeights, scratch: torch.Tensor
               ) -> tuple[StepShape, float]:
    """The shape a probe ran as (its mode is what the step reported) and the median seconds of
    its repeats after one warm-up run: one slow run (another process on the core) is not the
    shape."""
    shape, times = probe_runs(engine, probe, lora, rng, adapter, scratch)
    return shape, ProbeTiming(shape, tuple(times)).median_s


def probe_runs(engine: ProbedEngine, probe: CalibrationProbe, lora: LoRAConfig,
               rng: random.Random, adapter: AdapterWeights, scratch: torch.Tensor
               ) -> tuple[StepShape, list[float]]:
    """The shape a probe ran as and the seconds of each of its repeats (after one warm-up run,
    not timed)."""
    mc = engine.model.config
    times, shape = [], None
    for r in range(probe.repeats + 1):
        p = _Probe(engine, probe, rng)
        training = _probe_step(probe.shape, mc.vocab_size, lora, rng, scratch)
        try:
            t0 = time.perf_counter()
            result = engine.runner.run(p.batch, training, adapter)
            seconds = time.perf_counter() - t0
        finally:
            p.release()
        if r > 0:  # the first run of a shape warms caches and allocators
            times.append(seconds)
            shape = step_shape(p.batch, result.mode)
            if probe.shape.ft_lens:
                shape = shape.with_ft(probe.shape.ft_lens)
    assert shape is not None
    return shape, times


class NativeProber:
    """Times each probe on ``engine`` (which must be idle), its training rows on a stand-in
    adapter with PEFT's initial weights for ``lora``."""

    def __init__(self, engine: ProbedEngine, lora: LoRAConfig, *, seed: int = 0):
        self.engine, self.lora, self.seed = engine, lora, seed
        self.rng = random.Random(seed)
        self._adapter: AdapterWeights | None = None
        self._scratch: torch.Tensor | None = None

    @property
    def limits(self) -> HostLimits:
        return self.engine.limits

    def open(self, plan: Sequence[CalibrationProbe]) -> None:
        if self.engine.has_unfinished():
            raise RuntimeError("calibrate an idle engine: requests are in flight")
        mc, weights = self.engine.model.config, self.engine.model.weights
        self._adapter = AdapterWeights(mc, self.lora, device=weights.device).init_peft_(self.seed)
        self._scratch = torch.empty(mc.num_layers, self.limits.max_tokens_per_step,
                                    mc.hidden_size, dtype=weights.dtype, device=weights.device)

    def time(self, probe: CalibrationProbe) -> Sequence[ProbeTiming]:
        assert self._adapter is not None and self._scratch is not None, "open first"
        runner = self.engine.runner
        graphs = runner.graphs
        # a decode-only probe on a graph host runs both ways: base-model decodes replay graphs,
        # decodes carrying adapters run eager, and the model needs coefficients for both
        both = graphs is not None and probe.shape.is_decode_only and probe.shape.num_decode > 0
        timings = []
        for use_graphs in ((True, False) if both else (graphs is not None,)):
            runner.graphs = graphs if use_graphs else None
            try:
                shape, times = probe_runs(self.engine, probe, self.lora, self.rng, self._adapter,
                                          self._scratch)
            finally:
                runner.graphs = graphs
            timings.append(ProbeTiming(shape, tuple(times)))
        return timings

    def close(self) -> None:
        self._adapter = self._scratch = None
