"""Attach a co-server to any host, and detach it: the same steps for every host, through
:class:`deltaserve.core.contract.TrainingHost` only.

    co = attach(host, dataset="data.jsonl", slo=SLOConfig(ttft_s=2.0, tpot_s=0.3))
    ... serve ...
    detach(host)   # trains what was captured, checkpoints, stops the backward

Order: config and data are checked and tokenized first (a bad file fails before anything heavy
runs), then the host is calibrated (unless a latency model is given), the backward process
starts over the host's base weights, and the training adapter is installed in the host's
reserved slot before the first step can carry a sample.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import replace

from deltaserve.core.admission import AdmissionScheduler
from deltaserve.core.calibration import CalibrationConfig
from deltaserve.core.contract import TrainingHost
from deltaserve.core.data import DataConfig, TrainingSample
from deltaserve.core.errors import InputError
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.slo import SLOConfig
from deltaserve.model.llama import LlamaModel
from deltaserve.train.config import CoServeConfig
from deltaserve.train.facade import CoServer
from deltaserve.train.preflight import preflight

logger = logging.getLogger("deltaserve")

Dataset = str | os.PathLike | DataConfig | Sequence[TrainingSample]
LatencySource = LatencyModel | str | os.PathLike | None


def resolve_config(config: CoServeConfig | None, slo: SLOConfig | None,
                   overrides: dict[str, object]) -> CoServeConfig:
    """A full config, or an SLO plus keyword overrides of :class:`CoServeConfig` fields."""
    if config is None:
        if slo is None:
            raise InputError("slo", None, "give an SLO (ttft_s, tpot_s) or a full config")
        return CoServeConfig(slo=slo, **overrides)  # type: ignore[arg-type]
    return replace(config, **overrides) if overrides else config


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


def attach(host: TrainingHost, *, dataset: Dataset, slo: SLOConfig | None = None,
           config: CoServeConfig | None = None, latency_model: LatencySource = None,
           calibration: CalibrationConfig | None = None, progress: bool = True,
           scheduler_cls: type[AdmissionScheduler] = AdmissionScheduler,
           validation: Dataset | None = None, **overrides: object) -> CoServer:
    """Start co-serving on ``host`` (idle while it calibrates). ``config``: a full
    :class:`CoServeConfig`, else ``slo`` plus any of its fields as keyword overrides.
    ``latency_model``: a fitted model or its JSON; by default the host is calibrated now.
    ``scheduler_cls``: the admission policy (Algorithm 1; baselines substitute their own).
    ``validation``: held-out samples whose loss is reported (``ValidationLoss`` events)."""
    config = resolve_config(config, slo, overrides)
    dropout = host.training_dropout(config.lora)
    if dropout != config.lora.dropout:
        logger.warning("lora_dropout=%s: this host's LoRA forward applies dropout %s to "
                       "training rows, so the backward trains with %s (its gradients must be "
                       "those of the forward that produced the activations)",
                       config.lora.dropout, dropout, dropout)
        config = replace(config, lora=replace(config.lora, dropout=dropout))
    samples = resolve_samples(dataset, host, config.checkpoint.root)
    held_out = resolve_samples(validation, host) if validation is not None else []
    if isinstance(latency_model, (str, os.PathLike)):
        latency_model = LatencyModel.load(latency_model)
    if latency_model is None:
        latency_model = host.calibrate(config.lora, calibration, config.latency,
                                       seed=config.seed, progress=progress)
    model = LlamaModel(host.model_config, host.backward_weights())
    co = CoServer.for_model(config, host.limits, model, samples, base_model=host.model_path,
                            latency_model=latency_model, publish=host.publish_adapter,
                            scheduler_cls=scheduler_cls, validation=held_out)
    host.install_training_adapter(co.adapter)
    host.set_coserver(co)
    return co


def detach(host: TrainingHost, co: CoServer, *, drain: bool = True,
           checkpoint: bool = True) -> None:
    """Stop co-serving: the host stops calling ``co``; captured samples are trained
    (``drain``) or returned; a checkpoint of the last committed step is written."""
    host.set_coserver(None)
    co.close(drain=drain, checkpoint=checkpoint)
