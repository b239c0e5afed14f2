"""The smallest host there is, written against ``core/contract.py`` only: it proves a new engine
needs nothing else to co-serve. Its "engine" runs one prefill of fresh tokens per step (no KV
cache) through the model, with the co-server's training rows after it."""

from __future__ import annotations

import random
import time

import pytest
import torch

from deltaserve.core.admission import SchedulingView
from deltaserve.core.calibration import CalibrationConfig, HostLimits, build_plan
from deltaserve.core.contract import CoServingHooks, StepReport, TrainingHost, TrainingStep
from deltaserve.core.latency_model import LatencyModel, LatencyModelConfig, fit_from
from deltaserve.core.shape import StepShape
from deltaserve.model.attention import CausalSegments
from deltaserve.model.llama import ForwardContext, LlamaModel
from deltaserve.model.loading import load_weights
from deltaserve.model.lora import AdapterWeights, LoRAConfig, training_group
from deltaserve.train.attach import attach, detach
from tests.tiny import hf_tiny_llama
from tests.train import fixtures as fx


class FakeHost:
    """A ``TrainingHost`` whose every step is one inference prefill plus the training rows."""

    limits = HostLimits(max_tokens_per_step=256, max_seqs_per_step=16, max_model_len=256,
                        max_kv_tokens=4096)
    tokenizer = None

    def __init__(self, path):
        self.model_path = str(path)
        self.model = LlamaModel(*load_weights(path))
        self.model_config = self.model.config
        self.co: CoServingHooks | None = None
        self.adapter: AdapterWeights | None = None
        self.publishes = 0
        self.rng = random.Random(0)

    # ---- TrainingHost -----------------------------------------------------------------------
    def backward_weights(self):
        return self.model.weights

    def training_dropout(self, lora: LoRAConfig) -> float:
        return lora.dropout

    def install_training_adapter(self, adapter: AdapterWeights) -> None:
        self.adapter = adapter

    def publish_adapter(self, adapter: AdapterWeights) -> None:
        self.publishes += 1  # the adapter is shared memory: the next forward reads it

    def calibrate(self, lora, calibration: CalibrationConfig | None,
                  latency: LatencyModelConfig | None, *, seed: int, progress: bool
                  ) -> LatencyModel:
        return fit_from([(p.shape, 1e-3 + 1e-5 * p.shape.num_tokens)
                         for p in build_plan(self.limits, calibration)], latency)

    def set_coserver(self, co: CoServingHooks | None) -> None:
        self.co = co

    def has_unfinished(self) -> bool:
        return False

    # ---- the engine -------------------------------------------------------------------------
    def step(self, prefill: int) -> StepReport:
        assert self.co is not None and self.adapter is not None
        proposed = StepShape((prefill,)) if prefill else StepShape()
        step = self.co.plan(SchedulingView(proposed, time.monotonic()))
        t0 = time.perf_counter()
        self._forward(prefill, step)
        report = StepReport(step, step.plan.shape, time.perf_counter() - t0)
        self.co.observe(report)
        return report

    def _forward(self, prefill: int, step: TrainingStep) -> None:
        rows = step.rows
        ids = [self.rng.randrange(self.model_config.vocab_size) for _ in range(prefill)]
        ids += rows.flat_token_ids()
        positions = list(range(prefill)) + rows.positions()
        groups = (training_group(self.adapter, slice(prefill, len(ids)), rows),) \
            if rows.num_samples else ()
        lengths = ([prefill] if prefill else []) + list(rows.lengths)
        if not lengths:
            return  # nothing to run
        ctx = ForwardContext(torch.tensor(positions), CausalSegments(lengths), groups)

        def hook(layer: int, h: torch.Tensor) -> None:
            if rows.num_samples:
                step.capture(layer, h[prefill:])

        with torch.no_grad():
            self.model.forward(torch.tensor(ids, dtype=torch.long), ctx, hook)


@pytest.fixture(scope="module")
def base_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf_tiny_llama(seed=7).save_pretrained(path)
    return path


def test_a_host_written_against_the_contract_co_serves_end_to_end(base_path):
    host = FakeHost(base_path)
    assert isinstance(host, TrainingHost)
    samples = fx.samples(20)
    co = attach(host, dataset=samples, config=fx.config(batch_tokens=64), progress=False)
    assert isinstance(co, CoServingHooks)
    rec = fx.Recorder(co)
    init = co.adapter.flat.clone()
    try:
        mixed = 0
        deadline = time.monotonic() + 120
        while co.stats().ft_samples_committed < 20 and time.monotonic() < deadline:
            report = host.step(prefill=16 if mixed < 3 else 0)  # beside inference, then alone
            mixed += bool(report.step.rows.num_samples and report.shape.has_inference)
            if not report.step.rows.num_samples:
                co.idle(0.05)
    finally:
        detach(host, co, drain=False, checkpoint=False)
    assert mixed == 3  # training rows rode beside inference rows
    assert sorted(rec.committed_ids) == list(range(20))  # every sample once
    assert host.publishes == len(rec.steps) > 0  # each optimizer step reached the host
    assert not torch.equal(co.adapter.flat, init)  # and it trained
