"""Attach a co-server to any host, and detach it: the same steps for every host (native, vLLM,
SGLang, simulated), through :class:`deltaserve.core.contract.TrainingHost` only.

    co = attach(host, CoServeConfig(SLOConfig(ttft_s=2.0, tpot_s=0.3)), dataset="data.jsonl")
    ... serve ...
    detach(host, co)   # trains what was captured, checkpoints, stops the backward

Order: config and data are checked and tokenized first (a bad file fails before anything heavy
runs), then the host is calibrated (unless a latency model is given), the training half is
built (the real one starts the backward process over the host's base weights), and the training
adapter is installed in the host's reserved slot before the first step can carry a sample.

What trains is the one step that differs between hosts, and it enters as a
:class:`TrainingHalf`: :class:`TorchTraining` (the real trainer, the default) or a simulated
host's timed stand-in (:class:`deltaserve.hosts.sim.engine.SimTraining`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from deltaserve.core.admission import AdmissionScheduler
from deltaserve.core.calibration import CalibrationConfig
from deltaserve.core.contract import TrainingHost
from deltaserve.core.data import DataConfig, TrainingSample
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.pool import SamplePool
from deltaserve.model.llama import LlamaModel
from deltaserve.train.config import CoServeConfig
from deltaserve.train.facade import CoServer
from deltaserve.train.preflight import preflight
from deltaserve.train.trainer import TorchTrainerFactory
from deltaserve.train.trainer_protocol import TrainerFactory

logger = logging.getLogger("deltaserve")

Dataset = str | os.PathLike | DataConfig | Sequence[TrainingSample]
LatencySource = LatencyModel | str | os.PathLike | None


class TrainingHalf(Protocol):
    """What trains a host's captured samples: the one part of :func:`attach` that differs
    between hosts, built for one host."""

    def trainer_factory(self, config: CoServeConfig, validation: Sequence[TrainingSample]
                        ) -> TrainerFactory:
        """The co-server's trainer factory, once the config is final (dropout resolved) and
        the data and latency model are ready. ``validation``: held-out samples."""
        ...

    def install(self, co: CoServer) -> None:
        """Before the host's first step with ``co``: put what the host's forward reads (the
        training adapter) in place."""
        ...


class TorchTraining:
    """The real training half: the torch :class:`~deltaserve.train.trainer.Trainer` over the
    host's base weights (the backward process, optimizer, checkpoints), its adapter installed in
    the host's reserved slot and published to the host after every optimizer step."""

    def __init__(self, host: TrainingHost):
        self.host = host

    def trainer_factory(self, config: CoServeConfig, validation: Sequence[TrainingSample]
                        ) -> TrainerFactory:
        host = self.host
        model = LlamaModel(host.model_config, host.backward_weights())
        return TorchTrainerFactory(model, host.model_path, host.publish_adapter,
                                   tuple(validation))

    def install(self, co: CoServer) -> None:
        self.host.install_training_adapter(co.adapter)


def resolve_samples(dataset: Dataset, host: TrainingHost,
                    checkpoint_dir: str | None = None) -> list[TrainingSample]:
    """A path (Alpaca / chat / ShareGPT; samples up to one host step), a :class:`DataConfig`,
    or samples already tokenized; checked (with the checkpoint directory) by the shared
    preflight pass, so what was dropped is logged, never silent."""
    limit = min(host.limits.max_tokens_per_step, host.limits.max_model_len)
    if isinstance(dataset, (str, os.PathLike)):
        dataset = DataConfig(os.fspath(dataset), max_tokens=limit)
    if not isinstance(dataset, DataConfig):
        preflight(checkpoint_dir=checkpoint_dir)
        return list(dataset)
    checked = preflight(dataset=dataset, tokenizer=host.tokenizer,
                        checkpoint_dir=checkpoint_dir)
    assert checked.samples is not None
    return checked.samples


def attach(host: TrainingHost, config: CoServeConfig, *, dataset: Dataset,
           latency_model: LatencySource = None, calibration: CalibrationConfig | None = None,
           progress: bool = True, scheduler_cls: type[AdmissionScheduler] = AdmissionScheduler,
           validation: Dataset | None = None, pool: SamplePool | None = None,
           training: TrainingHalf | None = None,
           clock: Callable[[], float] = time.monotonic) -> CoServer:
    """Start co-serving on ``host`` (idle while it calibrates) under ``config``.
    ``latency_model``: a fitted model or its JSON; by default the host is calibrated now.
    ``scheduler_cls``: the admission policy (Algorithm 1; baselines substitute their own).
    ``validation``: held-out samples whose loss is reported (``ValidationLoss`` events).
    ``pool``: a sample pool shared with other replicas' co-servers (by default its own).
    ``training``: what trains (default: :class:`TorchTraining` over ``host``). ``clock``: the
    host's clock (a simulated host's simulated time).

    Data parallel (``config.data_parallel`` of more than one replica): the backward process
    joins the replicas' group as it starts, and that waits for every replica's, so the replicas
    must attach concurrently (each on its own thread or process), within the group's
    ``timeout_s``."""
    dropout = host.training_dropout(config.lora)
    if dropout != config.lora.dropout:
        logger.warning("lora_dropout=%s: this host's LoRA forward applies dropout %s to "
                       "training rows, so the backward trains with %s (its gradients must be "
                       "those of the forward that produced the activations)",
                       config.lora.dropout, dropout, dropout)
        config = replace(config, lora=replace(config.lora, dropout=dropout))
    samples = resolve_samples(dataset, host, config.checkpoint.root)
    if config.data_shard is not None:  # every replica needs a sample each epoch: check now
        config.data_shard.check_dataset(len(samples))
    held_out = resolve_samples(validation, host) if validation is not None else []
    if isinstance(latency_model, (str, os.PathLike)):
        latency_model = LatencyModel.load(latency_model)
    if latency_model is None:
        latency_model = host.calibrate(config.lora, calibration, config.latency,
                                       seed=config.seed, progress=progress)
    if training is None:
        training = TorchTraining(host)
    co = CoServer(config, host.limits, samples, training.trainer_factory(config, held_out),
                  latency_model=latency_model, scheduler_cls=scheduler_cls, pool=pool,
                  clock=clock)
    training.install(co)
    host.set_coserver(co)
    return co


def detach(host: TrainingHost, co: CoServer, *, drain: bool = True,
           checkpoint: bool = True) -> None:
    """Stop co-serving: the host stops calling ``co``; captured samples are trained
    (``drain``) or returned; a checkpoint of the last committed step is written."""
    host.set_coserver(None)
    co.close(drain=drain, checkpoint=checkpoint)
