"""The :class:`~deltaserve.core.contract.TrainingSide` members an engine host takes, unchanged,
from the object that holds its engine's training side.

An engine host (vLLM's in-process and engine-process hosts, SGLang's) splits in two: the client
half (:class:`~deltaserve.hosts.base.BaseHost`) and the co-server's half, which lives next to the
engine's scheduler. The host answers the co-server's questions about the model and the training
adapter by asking that half; this mixin is that delegation, written once.
"""

from __future__ import annotations

from deltaserve.core.calibration import HostLimits
from deltaserve.core.contract import TrainingSide
from deltaserve.model.config import ModelConfig
from deltaserve.model.llama import BaseWeights
from deltaserve.model.lora import AdapterWeights, LoRAConfig


class DelegatedTraining:
    """Mixin: the ``TrainingSide`` members of ``TrainingHost``, answered by ``self.training``."""

    training: TrainingSide

    @property
    def limits(self) -> HostLimits:
        return self.training.limits

    @property
    def model_path(self) -> str:
        return self.training.model_path

    @property
    def model_config(self) -> ModelConfig:
        return self.training.model_config

    def backward_weights(self) -> BaseWeights:
        return self.training.backward_weights()

    def training_dropout(self, lora: LoRAConfig) -> float:
        return self.training.training_dropout(lora)

    def install_training_adapter(self, adapter: AdapterWeights) -> None:
        self.training.install_training_adapter(adapter)

    def publish_adapter(self, adapter: AdapterWeights) -> None:
        self.training.publish_adapter(adapter)
