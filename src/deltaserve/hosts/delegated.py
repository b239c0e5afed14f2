"""The :class:`~deltaserve.core.contract.TrainingHost` members an engine host takes, unchanged,
from the object that holds its engine's training side.

An engine host (vLLM's in-process and engine-process hosts, SGLang's) splits in two: the client
half (:class:`~deltaserve.hosts.base.BaseHost`) and the co-server's half, which lives next to the
engine's scheduler. The host answers the co-server's questions by asking that half; this mixin is
that delegation, written once.
"""

from __future__ import annotations

from typing import Protocol

from deltaserve.core.calibration import HostLimits
from deltaserve.core.shape import ExecMode, StepShape
from deltaserve.model.config import ModelConfig
from deltaserve.model.llama import BaseWeights
from deltaserve.model.lora import AdapterWeights, LoRAConfig


class EngineTrainingSide(Protocol):
    """What an engine's training side answers (a subset of ``TrainingHost`` plus the execution
    mode the engine will run a step shape in)."""

    @property
    def limits(self) -> HostLimits: ...

    @property
    def model_path(self) -> str: ...

    @property
    def model_config(self) -> ModelConfig: ...

    def execution_mode(self, shape: StepShape) -> ExecMode: ...

    def backward_weights(self) -> BaseWeights: ...

    def training_dropout(self, lora: LoRAConfig) -> float: ...

    def install_training_adapter(self, adapter: AdapterWeights) -> None: ...

    def publish_adapter(self, adapter: AdapterWeights) -> None: ...


class DelegatedTraining:
    """Mixin: these ``TrainingHost`` members answered by ``self.training``."""

    training: EngineTrainingSide

    @property
    def limits(self) -> HostLimits:
        return self.training.limits

    @property
    def model_path(self) -> str:
        return self.training.model_path

    @property
    def model_config(self) -> ModelConfig:
        return self.training.model_config

    def execution_mode(self, shape: StepShape) -> ExecMode:
        return self.training.execution_mode(shape)

    def backward_weights(self) -> BaseWeights:
        return self.training.backward_weights()

    def training_dropout(self, lora: LoRAConfig) -> float:
        return self.training.training_dropout(lora)

    def install_training_adapter(self, adapter: AdapterWeights) -> None:
        self.training.install_training_adapter(adapter)

    def publish_adapter(self, adapter: AdapterWeights) -> None:
        self.training.publish_adapter(adapter)
