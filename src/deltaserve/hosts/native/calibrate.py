"""Start-up calibration: the profiling plan run through the engine's real forward path.

Each probe becomes a real batch: synthetic requests that own real KV blocks (their cached
context is not computed: attention costs the same whatever the cached values are), plus
training rows on a stand-in training adapter with the co-server's LoRA config and a capture
copy of the same size. One untimed warm-up run precedes the timed repeats of every probe; the
probe's observation is the median of its repeats.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from deltaserve.core.calibration import CalibrationConfig, CalibrationProbe, build_plan
from deltaserve.core.latency_model import LatencyModel, LatencyModelConfig
from deltaserve.core.requests import SamplingParams
from deltaserve.core.shape import StepShape
from deltaserve.hosts.native.request import Request
from deltaserve.hosts.native.scheduler import ScheduledBatch, ScheduledItem
from deltaserve.hosts.native.view import step_shape
from deltaserve.hosts.probe import ProbeStep, probe_step, random_rows
from deltaserve.model.lora import AdapterWeights, LoRAConfig

if TYPE_CHECKING:  # the engine calls this module
    from deltaserve.hosts.native.engine import LLMEngine


class _Probe:
    """The requests of one probe, holding KV blocks until released."""

    def __init__(self, engine: LLMEngine, probe: CalibrationProbe, rng: random.Random):
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


def time_probe(engine: LLMEngine, probe: CalibrationProbe, lora: LoRAConfig,
               rng: random.Random, adapter: AdapterWeights, scratch: torch.Tensor
               ) -> tuple[StepShape, float]:
    """The shape a probe ran as (its mode is what the step reported) and the median seconds of
    its repeats after one warm-up run: one slow run (another process on the core) is not the
    shape."""
    shape, times = probe_runs(engine, probe, lora, rng, adapter, scratch)
    return shape, statistics.median(times)


def probe_runs(engine: LLMEngine, probe: CalibrationProbe, lora: LoRAConfig,
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


def calibrate(engine: LLMEngine, lora: LoRAConfig, config: CalibrationConfig | None = None,
              latency: LatencyModelConfig | None = None, *, seed: int = 0,
              progress: bool = True) -> LatencyModel:
    """Time the calibration plan on ``engine`` (which must be idle) and fit a latency model."""
    if engine.has_unfinished():
        raise RuntimeError("calibrate an idle engine: requests are in flight")
    plan = build_plan(engine.limits, config)
    model = LatencyModel(latency)
    mc = engine.model.config
    adapter = AdapterWeights(mc, lora, device=engine.model.weights.device).init_peft_(seed)
    scratch = torch.empty(mc.num_layers, engine.limits.max_tokens_per_step, mc.hidden_size,
                          dtype=engine.model.weights.dtype, device=engine.model.weights.device)
    rng = random.Random(seed)
    graphs = engine.runner.graphs
    for probe in tqdm(plan, desc="calibrating", unit="probe", disable=not progress):
        # a decode-only probe on a graph host runs both ways: base-model decodes replay graphs,
        # decodes carrying adapters run eager, and the model needs coefficients for both
        both = graphs is not None and probe.shape.is_decode_only and probe.shape.num_decode > 0
        for use_graphs in ((True, False) if both else (graphs is not None,)):
            engine.runner.graphs = graphs if use_graphs else None
            try:
                shape, seconds = time_probe(engine, probe, lora, rng, adapter, scratch)
            finally:
                engine.runner.graphs = graphs
            model.add_calibration(shape, seconds)
    model.fit()
    return model
