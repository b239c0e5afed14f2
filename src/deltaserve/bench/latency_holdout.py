"""The latency model's error on two sets of steps, per execution mode.

* *online*: every step the model learns from, predicted just before it learns from it (the
  model's own :meth:`~deltaserve.core.latency_model.LatencyModel.online_error`);
* *held out*: every k-th served step (counted over all steps, from the run's start) is
  predicted with the model of that moment and never learned from. Those steps are apart from
  every fit the model ever makes, so their error cannot be a product of the online refit
  chasing the most recent steps.

Both use the same filter (steps of at least ``min_seconds``) and the same MAPE.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from deltaserve.core.latency_model import LatencyModel, LatencyModelConfig, OnlineError
from deltaserve.core.shape import ExecMode, StepShape


class HoldoutLatencyModel(LatencyModel):
    """A latency model that sets every ``every``-th observed step apart (``every`` 0: none).
    Build it with ``HoldoutLatencyModel.load(path)`` and set :attr:`every`."""

    def __init__(self, config: LatencyModelConfig | None = None):
        super().__init__(config)
        self.every = 0
        self._observed = 0
        self._heldout: dict[ExecMode, list[tuple[float, float]]] = {}

    def observe(self, shape: StepShape, seconds: float) -> float | None:
        self._observed += 1
        if self.every and self._observed % self.every == 0 and self.is_calibrated:
            predicted = self.predict(shape)
            if math.isfinite(predicted) and seconds > 0:
                self._heldout.setdefault(shape.mode, []).append((predicted, seconds))
            return predicted
        return super().observe(shape, seconds)

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
