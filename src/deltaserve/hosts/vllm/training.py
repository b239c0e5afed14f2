"""The co-server's side of the host contract (:class:`~deltaserve.core.contract.TrainingHost`)
for one vLLM engine, wherever the co-server runs: the in-process :class:`~.host.VLLMHost`
delegates to it, and so does the engine process of ``deltaserve serve`` (:mod:`.remote`).

LoRA dropout: where the worker's hooks add the training adapter to the training rows
(:mod:`.direct_lora`) they apply the co-server's seeded masks, and ``training_dropout`` is the
LoRA config's; where vLLM's LoRA ops do (the compiled ``aux`` path), which have no dropout, the
captured activations are those of a dropout-free forward, the backward must replay that, and it
is 0.0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm.config import VllmConfig

from deltaserve.core.calibration import Batching, CalibrationConfig, HostLimits
from deltaserve.core.latency_model import LatencyModel, LatencyModelConfig
from deltaserve.hosts.vllm.calibrate import CalibrationRun, EngineFacts
from deltaserve.hosts.vllm.link import EngineLink
from deltaserve.hosts.vllm.publish import AdapterPublisher
from deltaserve.hosts.vllm.scheduler import CoServingScheduler
from deltaserve.hosts.vllm.train_adapter import reserve
from deltaserve.hosts.vllm.weights import backward_weights
from deltaserve.model.config import ModelConfig
from deltaserve.model.llama import BaseWeights
from deltaserve.model.loading import read_config, resolve_model
from deltaserve.model.lora import AdapterWeights, LoRAConfig


def engine_limits(vllm_config: VllmConfig, scheduler: CoServingScheduler) -> HostLimits:
    """What one step of the engine holds. A sample is a prompt that must leave room for the one
    token vLLM samples after it, hence ``max_model_len - 1``."""
    sc, cc = vllm_config.scheduler_config, vllm_config.cache_config
    return HostLimits(scheduler.max_num_scheduled_tokens, sc.max_num_seqs,
                      vllm_config.model_config.max_model_len - 1,
                      (cc.num_gpu_blocks or 0) * scheduler.block_size, Batching.MIXED)


class EngineTraining:
    """What attaching a co-server asks of the engine behind ``link`` (built from
    ``vllm_config``, its scheduler and hooks installed)."""

    def __init__(self, link: EngineLink, vllm_config: VllmConfig):
        if link.scheduler is None or link.runner is None:
            raise RuntimeError("vLLM runs without DeltaServe's scheduler or worker hooks")
        self.link = link
        self.scheduler: CoServingScheduler = link.scheduler
        self.vllm_config = vllm_config
        self.model_path = str(vllm_config.model_config.model)
        self.model_config: ModelConfig = read_config(resolve_model(self.model_path))
        self.dtype: torch.dtype = vllm_config.model_config.dtype

    @property
    def limits(self) -> HostLimits:
        return engine_limits(self.vllm_config, self.scheduler)

    def backward_weights(self) -> BaseWeights:
        """Views of vLLM's weights (GPU), or a reload from the model directory (CPU, where vLLM
        repacks its weights): see :mod:`.weights`."""
        assert self.link.runner is not None
        return backward_weights(self.link.runner.model, self.model_config, self.model_path,
                                self.dtype)

    def training_dropout(self, lora: LoRAConfig) -> float:
        # the worker's hooks apply the seeded masks (direct); vLLM's LoRA ops have no dropout
        return lora.dropout if self.link.direct_lora else 0.0

    def install_training_adapter(self, adapter: AdapterWeights) -> None:
        """Reserve the slot (unless calibration reserved it for the same LoRA config) and make
        it hold exactly ``adapter``."""
        self._publisher(adapter.config, lambda: adapter).publish(adapter)

    def publish_adapter(self, adapter: AdapterWeights) -> None:
        if self.link.publisher is None:
            raise RuntimeError("no training adapter is reserved: attach first")
        self.link.publisher.publish(adapter)

    def calibration_run(self, lora: LoRAConfig, calibration: CalibrationConfig | None,
                        latency: LatencyModelConfig | None, *, seed: int,
                        progress: bool = False,
                        on_done: Callable[[LatencyModel], None] | None = None
                        ) -> CalibrationRun:
        """A calibration plan for the scheduler to run; its training rows use the training
        adapter, reserved here with PEFT's initial weights for ``lora`` if need be."""
        self._publisher(lora, lambda: AdapterWeights(self.model_config, lora).init_peft_(seed))
        assert self.link.train_lora is not None
        cc = self.vllm_config.cache_config
        facts = EngineFacts(self.limits, self.model_config, self.dtype,
                            self.scheduler.block_size, bool(cc.enable_prefix_caching))
        return CalibrationRun(facts, calibration, latency, self.link.sample_lora,
                              self.training_dropout(lora), seed=seed, progress=progress,
                              on_done=on_done)

    def _publisher(self, lora: LoRAConfig, weights: Callable[[], AdapterWeights]
                   ) -> AdapterPublisher:
        """The reserved slot's publisher, reserving it (for ``lora``) if it holds another
        config or nothing."""
        publisher = self.link.publisher
        if publisher is None or publisher.config != lora:
            publisher = reserve(self.link, weights(), self.model_path)
        return publisher
