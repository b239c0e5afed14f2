"""The latency model's error on two sets of steps, per execution mode.

* *online*: every step the model learns from, predicted just before it learns from it (the
  model's own :meth:`~deltaserve.core.latency_model.LatencyModel.online_error`);
* *held out*: every k-th served step (counted over all steps, from the run's start) is
  predicted with the model of that moment and never learned from. Those steps are apart from
  every fit the model ever makes, so their error cannot be a product of the online refit
  chasing the most recent steps.

Both use the same filter (steps of at least ``min_seconds``) and the same MAPE.

The online error is also split by *step kind* (:class:`StepKind`: decode-only, inference
prefill, inference beside fine-tuning rows, fine-tuning rows alone), each with its bias, the
mean of actual ÷ predicted less one (positive: steps ran slower than predicted). A per-mode
MAPE says how far off the model is; the split says on which steps, which is where a fix starts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from deltaserve.core.contract import StepRecord
from deltaserve.core.latency_model import LatencyModel, LatencyModelConfig, OnlineError
from deltaserve.core.shape import ExecMode, StepKind, StepShape, kind_of


class HoldoutLatencyModel(LatencyModel):
    """A latency model that sets every ``every``-th observed step apart (``every`` 0: none).
    Build it with ``HoldoutLatencyModel.load(path)`` and set :attr:`every`."""

    def __init__(self, config: LatencyModelConfig | None = None):
        super().__init__(config)
        self.every = 0
        self._observed = 0
        self._heldout: dict[ExecMode, list[tuple[float, float]]] = {}
        # every online step's (predicted, actual), by kind; unlike the model's own error ring it
        # never ages out, so over a run longer than the ring it covers more steps than the
        # per-mode MAPE does
        self._online_by_kind: dict[tuple[StepKind, ExecMode], list[tuple[float, float]]] = {}
        # every step's prediction, held out or not, by the (shape, seconds) the host also logs
        # it with: a late request's steps are then set beside what the model expected of them
        self._predicted: dict[tuple[StepShape, float], float] = {}

    def observe(self, shape: StepShape, seconds: float) -> float | None:
        self._observed += 1
        if self.every and self._observed % self.every == 0 and self.is_calibrated:
            predicted = self.predict(shape)
            if math.isfinite(predicted) and seconds > 0:
                self._heldout.setdefault(shape.mode, []).append((predicted, seconds))
                self._predicted[shape, seconds] = predicted
            return predicted
        predicted = super().observe(shape, seconds)
        if predicted is not None and math.isfinite(predicted) and seconds > 0:
            key = (kind_of(shape), shape.mode)
            self._online_by_kind.setdefault(key, []).append((predicted, seconds))
            self._predicted[shape, seconds] = predicted
        return predicted

    def step_predictions(self) -> dict[tuple[StepShape, float], float]:
        """Each step's prediction just before the model saw it, by (shape, seconds)."""
        return dict(self._predicted)

    def online_error_by_kind(self, min_seconds: float = 0.0) -> tuple[KindError, ...]:
        """The online steps of at least ``min_seconds``, per (kind, mode), in kind order."""
        out = []
        for kind in StepKind:
            for mode in ExecMode:
                d = np.array([r for r in self._online_by_kind.get((kind, mode), ())
                              if r[1] >= min_seconds])
                if len(d):
                    out.append(KindError(
                        kind.value, mode.value, len(d),
                        float(np.mean(np.abs(d[:, 0] - d[:, 1]) / d[:, 1])),
                        float(np.mean(d[:, 1] / d[:, 0]) - 1.0)))
        return tuple(out)

    def heldout_error(self, min_seconds: float = 0.0) -> tuple[OnlineError, ...]:
        """Per-mode MAPE of the held-out steps of at least ``min_seconds``."""
        out = []
        for mode, rows in sorted(self._heldout.items()):
            d = np.array([r for r in rows if r[1] >= min_seconds])
            if len(d):
                mape = float(np.mean(np.abs(d[:, 0] - d[:, 1]) / d[:, 1]))
                out.append(OnlineError(mode, len(d), mape, min_seconds))
        return tuple(out)


@dataclass(frozen=True)
class ModeError:
    """One execution mode's MAPE on the online and the held-out steps (None: no such step)."""

    mode: str
    online_mape: float | None
    online_steps: int
    heldout_mape: float | None
    heldout_steps: int

    def as_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class KindError:
    """The online error on one kind of step in one mode: ``mape``, and ``bias``, the mean of
    actual ÷ predicted less one (positive: slower than predicted)."""

    kind: str
    mode: str
    steps: int
    mape: float
    bias: float

    def as_json(self) -> dict:
        return asdict(self)


def errors_by_kind(model: LatencyModel | None, min_seconds: float) -> tuple[KindError, ...]:
    """The online error split by step kind (empty for a model that keeps no split)."""
    if not isinstance(model, HoldoutLatencyModel):
        return ()
    return model.online_error_by_kind(min_seconds)


def errors_by_yield(steps: Sequence[StepRecord],
                    predictions: Mapping[tuple[StepShape, float], float],
                    min_seconds: float) -> tuple[KindError, ...]:
    """The error of every step the model predicted, by kind and by whether the host lent the
    backward time just before it (``kind`` reads e.g. ``decode after a yield``): a step that
    runs slower right after the backward computed is a bias no shape term can learn."""
    groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for s in steps:
        predicted = predictions.get((s.shape, s.seconds))
        if predicted is None or s.seconds < min_seconds or predicted <= 0:
            continue
        where = "after a yield" if s.yielded_s > 0 else "no yield"
        key = (f"{kind_of(s.shape).value} {where}", s.shape.mode.value)
        groups.setdefault(key, []).append((predicted, s.seconds))
    out = []
    for (kind, mode), rows in sorted(groups.items()):
        d = np.array(rows)
        mape = float(np.mean(np.abs(d[:, 0] - d[:, 1]) / d[:, 1]))
        out.append(KindError(kind, mode, len(d), mape, float(np.mean(d[:, 1] / d[:, 0]) - 1.0)))
    return tuple(out)


def step_predictions(model: LatencyModel | None) -> dict[tuple[StepShape, float], float]:
    """The steps' predictions (empty for a model that keeps none)."""
    return model.step_predictions() if isinstance(model, HoldoutLatencyModel) else {}


def pooled_kind_errors(per_run: Sequence[tuple[KindError, ...]]) -> tuple[KindError, ...]:
    """Each (kind, mode)'s error over every repeat's steps: both figures are means over steps,
    so the step-weighted mean of the repeats' is exact."""
    groups: dict[tuple[str, str], list[KindError]] = {}
    for errors in per_run:
        for e in errors:
            groups.setdefault((e.kind, e.mode), []).append(e)
    out = []
    for (kind, mode), errs in groups.items():
        n = sum(e.steps for e in errs)
        out.append(KindError(kind, mode, n, sum(e.mape * e.steps for e in errs) / n,
                             sum(e.bias * e.steps for e in errs) / n))
    return tuple(out)


def errors_by_mode(model: LatencyModel | None, min_seconds: float) -> tuple[ModeError, ...]:
    """Every execution mode with a scored step of at least ``min_seconds``, in mode order."""
    if model is None:
        return ()
    online = {e.mode: e for e in model.online_error(min_seconds)}
    held = ({e.mode: e for e in model.heldout_error(min_seconds)}
            if isinstance(model, HoldoutLatencyModel) else {})
    out = []
    for mode in ExecMode:
        o, h = online.get(mode), held.get(mode)
        if o is None and h is None:
            continue
        out.append(ModeError(mode.value, o.mape if o else None, o.num_steps if o else 0,
                             h.mape if h else None, h.num_steps if h else 0))
    return tuple(out)
