"""OpenAI's fine-tuning hyperparameters, and how they map onto a co-serving job.

=============================  ==========================================================
OpenAI                          DeltaServe
=============================  ==========================================================
``n_epochs``                    epochs over the training file; ``auto``: the server's
                                co-serving config (``CoServeConfig.num_epochs``)
``learning_rate_multiplier``    × the server's LoRA learning rate (``--optimizer-lr``);
                                ``auto``: 1
``batch_size`` (examples)       the backward batch is measured in tokens: ``batch_size`` ×
                                the training file's mean sample length (tokens, rounded up);
                                ``auto``: the server's backward batch
                                (``--backward-batch-tokens``), reported back as the number
                                of mean-length samples it holds
=============================  ==========================================================

The ``auto`` values are the runner's :class:`JobDefaults` (:func:`job_defaults` of the
server's :class:`CoServeConfig`).
Like OpenAI, a job reports the resolved numbers in place of ``auto`` once its files are
validated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from deltaserve.core.data import TrainingSample
from deltaserve.core.errors import require
from deltaserve.server.protocols import JobDefaults, TrainingHyperparameters
from deltaserve.train.config import CoServeConfig

Auto = Literal["auto"]
AUTO: Auto = "auto"
MAX_EPOCHS = 50  # OpenAI's bound


def job_defaults(config: CoServeConfig, max_sample_tokens: int) -> JobDefaults:
    """A runner's ``auto`` values from its co-serving config."""
    require(config.num_epochs is not None, "num_epochs", config.num_epochs,
            "a fine-tuning job must end: give a number of epochs")
    assert config.num_epochs is not None
    return JobDefaults(config.num_epochs, config.optimizer.lr, config.backward.batch_tokens,
                       max_sample_tokens)


@dataclass(frozen=True)
class Hyperparameters:
    """OpenAI's three knobs as a job reports them (``auto`` until resolved)."""

    n_epochs: int | Auto = AUTO
    learning_rate_multiplier: float | Auto = AUTO
    batch_size: int | Auto = AUTO

    def __post_init__(self) -> None:
        for name, kind in (("n_epochs", int), ("learning_rate_multiplier", float),
                           ("batch_size", int)):
            value = getattr(self, name)
            if value == AUTO:
                continue
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            require(ok, f"hyperparameters.{name}", value, "must be 'auto' or a number")
            require(kind is float or float(value).is_integer(), f"hyperparameters.{name}",
                    value, "must be 'auto' or an integer")
            require(value > 0 and math.isfinite(value), f"hyperparameters.{name}", value,
                    "must be > 0")
        require(self.n_epochs == AUTO or self.n_epochs <= MAX_EPOCHS, "hyperparameters.n_epochs",
                self.n_epochs, f"must be <= {MAX_EPOCHS}")

    def as_dict(self) -> dict[str, int | float | str]:
        return dataclasses.asdict(self)


def mean_sample_tokens(samples: Sequence[TrainingSample]) -> int:
    return math.ceil(sum(s.num_tokens for s in samples) / len(samples))


def resolve(requested: Hyperparameters, samples: Sequence[TrainingSample],
            defaults: JobDefaults) -> tuple[Hyperparameters, TrainingHyperparameters]:
    """The numbers reported back to the client, and what the runner trains with."""
    mean_tokens = mean_sample_tokens(samples)
    epochs = defaults.n_epochs if requested.n_epochs == AUTO else int(requested.n_epochs)
    mult = 1.0 if requested.learning_rate_multiplier == AUTO else float(
        requested.learning_rate_multiplier)
    if requested.batch_size == AUTO:
        batch_tokens = defaults.backward_batch_tokens
        batch_size = max(1, round(batch_tokens / mean_tokens))
    else:
        batch_size = int(requested.batch_size)
        batch_tokens = batch_size * mean_tokens
    reported = Hyperparameters(epochs, mult, batch_size)
    return reported, TrainingHyperparameters(epochs, mult * defaults.learning_rate, batch_tokens)
