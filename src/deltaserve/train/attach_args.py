"""What every host's ``attach`` accepts, resolved the same way for all of them."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from deltaserve.core.data import DataConfig, TrainingSample, load_dataset
from deltaserve.core.errors import InputError
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.slo import SLOConfig
from deltaserve.train.coserver import CoServeConfig

Dataset = str | os.PathLike | DataConfig | Sequence[TrainingSample]


def resolve_config(config: CoServeConfig | None, slo: SLOConfig | None,
                   overrides: dict[str, Any]) -> CoServeConfig:
    """A full config, or an SLO plus keyword overrides of :class:`CoServeConfig` fields."""
    if config is None:
        if slo is None:
            raise InputError("slo", None, "give an SLO (ttft_s, tpot_s) or a full config")
        return CoServeConfig(slo=slo, **overrides)
    return replace(config, **overrides) if overrides else config


def resolve_samples(dataset: Dataset, tokenizer: Any, max_tokens: int) -> list[TrainingSample]:
    """A path (Alpaca JSON/JSONL or chat JSONL; samples up to ``max_tokens``), a
    :class:`DataConfig`, or samples already tokenized."""
    if isinstance(dataset, (str, os.PathLike)):
        dataset = DataConfig(os.fspath(dataset), max_tokens=max_tokens)
    if isinstance(dataset, DataConfig):
        if tokenizer is None:
            raise InputError("dataset", dataset.path, "tokenizing needs the model's tokenizer")
        return load_dataset(dataset, tokenizer)[0]
    return list(dataset)


def resolve_latency_model(latency_model: LatencyModel | str | os.PathLike | None
                          ) -> LatencyModel | None:
    if isinstance(latency_model, (str, os.PathLike)):
        return LatencyModel.load(latency_model)
    return latency_model
