"""The co-server of a real host: the policy facade (:class:`deltaserve.train.facade.BaseCoServer`)
over the torch :class:`~deltaserve.train.trainer.Trainer` (adapter, optimizer state, activation
buffer, the backward process and its grant, the checkpointer)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from deltaserve.core.admission import AdmissionScheduler
from deltaserve.core.calibration import HostLimits
from deltaserve.core.data import TrainingSample
from deltaserve.core.latency_model import LatencyModel
from deltaserve.model.llama import LlamaModel
from deltaserve.model.lora import AdapterWeights
from deltaserve.train.backward.driver import resolve_policy
from deltaserve.train.config import CoServeConfig
from deltaserve.train.events import CoServeStats
from deltaserve.train.facade import BaseCoServer
from deltaserve.train.samples import SampleBook
from deltaserve.train.trainer import Publish, Trainer

__all__ = ["CoServeConfig", "CoServer", "TorchTrainerFactory"]


@dataclass(frozen=True)
class TorchTrainerFactory:
    """Builds the real trainer over ``model``'s weights, with the grant policy resolved for the
    device the weights live on."""

    model: LlamaModel
    base_model: str
    publish: Publish | None = None
    validation: tuple[TrainingSample, ...] = ()  # held-out samples, validated in the backward

    def __call__(self, config: CoServeConfig, book: SampleBook) -> Trainer:
        b = resolve_policy(config.backward, self.model.weights.device.type == "cuda",
                           torch.get_num_threads())
        return Trainer(replace(config, backward=b), self.model, book,
                       base_model=self.base_model, publish=self.publish,
                       validation=self.validation)


class CoServer(BaseCoServer):
    trainer: Trainer

    def __init__(self, config: CoServeConfig, limits: HostLimits, model: LlamaModel,
                 samples: Sequence[TrainingSample], *, base_model: str,
                 latency_model: LatencyModel | None = None, publish: Publish | None = None,
                 scheduler_cls: type[AdmissionScheduler] = AdmissionScheduler,
                 validation: Sequence[TrainingSample] = ()):
        self.model = model
        super().__init__(config, limits, samples, TorchTrainerFactory(model, base_model, publish,
                                                             tuple(validation)),
                         latency_model=latency_model, scheduler_cls=scheduler_cls)

    def stats(self) -> CoServeStats:
        return replace(super().stats(), steps_lost=dict(self.trainer.lost.by_kind))

    @property
    def adapter(self) -> AdapterWeights:
        """The trained adapter (shared with the backward; published after every step)."""
        return self.trainer.adapter
