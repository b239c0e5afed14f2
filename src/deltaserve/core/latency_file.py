"""Reading a latency-model JSON file (see ``LatencyModel.save``), every field checked.

A calibration file is trusted input to admission: a coefficient vector of the wrong length
crashes the serving loop at its first prediction, and a negative coefficient makes every amount
of training look free. So each field is checked here, before the model exists, and a bad one is
an :class:`InputError` naming the field (``keys[2].coefficients``) and its value.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from deltaserve.core.errors import InputError, require
from deltaserve.core.jsontypes import JsonObject, JsonValue
from deltaserve.core.latency_terms import TERMS, Equation

# format -> equation -> names of its coefficients (one feature per coefficient)
Layouts = Mapping[str, Mapping[str, tuple[str, ...]]]
FORMAT = "deltaserve.latency_model/2"
FORMAT_V1 = "deltaserve.latency_model/1"  # before the ζ term; still loads
LAYOUTS: Layouts = {
    FORMAT: {eq.value: TERMS[eq] for eq in Equation},
    FORMAT_V1: {eq.value: tuple(t for t in TERMS[eq] if t != "zeta") for eq in Equation}}


@dataclass(frozen=True)
class KeyEntry:
    """One fitted (equation, mode) of a file, in the layout of the file's own format."""

    equation: str
    mode: str
    coefficients: list[float] | None  # None: not fitted
    margin: float
    anchors: list[list[float]]  # rows of (features..., seconds)
    online: list[list[float]]


@dataclass(frozen=True)
class LatencyDocument:
    format: str
    config: JsonObject  # LatencyModelConfig's fields, checked by its constructor
    entries: tuple[KeyEntry, ...]


def read_document(path: str | os.PathLike, layouts: Layouts,
                  modes: tuple[str, ...]) -> LatencyDocument:
    """The checked contents of ``path``; ``layouts`` names the formats accepted."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError("latency_model_path", str(path), f"cannot read: {e}") from e
    require(isinstance(doc, dict), "latency_model_path", str(path),
            f"holds a JSON {type(doc).__name__}, not a DeltaServe latency-model object")
    fmt = doc.get("format")
    require(fmt in layouts, "format", fmt,
            f"{path} is not a DeltaServe latency-model file (formats: {', '.join(layouts)})")
    require(isinstance(doc.get("config"), dict), "config", doc.get("config"),
            f"must be an object in {path}")
    require(isinstance(doc.get("keys"), list), "keys", doc.get("keys"),
            f"must be a list of fitted (equation, mode) entries in {path}")
    entries = tuple(_entry(raw, f"keys[{i}]", layouts[fmt], modes, path)
                    for i, raw in enumerate(doc["keys"]))
    seen: set[tuple[str, str]] = set()
    for i, e in enumerate(entries):
        require((e.equation, e.mode) not in seen, f"keys[{i}]", f"{e.equation}/{e.mode}",
                f"appears twice in {path}")
        seen.add((e.equation, e.mode))
    return LatencyDocument(fmt, doc["config"], entries)


def _entry(raw: JsonValue, where: str, layout: Mapping[str, tuple[str, ...]],
           modes: tuple[str, ...], path: str | os.PathLike) -> KeyEntry:
    require(isinstance(raw, dict), where, raw, f"must be an object in {path}")
    for name in ("equation", "mode", "coefficients", "margin"):
        require(name in raw, f"{where}.{name}", None, f"missing in {path}")
    require(raw["equation"] in layout, f"{where}.equation", raw["equation"],
            f"must be one of {', '.join(layout)} in {path}")
    require(raw["mode"] in modes, f"{where}.mode", raw["mode"],
            f"must be one of {', '.join(modes)} in {path}")
    terms = layout[raw["equation"]]
    if raw["coefficients"] is not None:
        _numbers(raw["coefficients"], len(terms), f"{where}.coefficients", path,
                 f"({', '.join(terms)})")
    _numbers([raw["margin"]], 1, f"{where}.margin", path, "")
    rows: dict[str, list[list[float]]] = {}
    for name in ("anchors", "online"):  # observations: optional (a hand-written fit has none)
        rows[name] = raw.get(name, [])
        require(isinstance(rows[name], list), f"{where}.{name}", rows[name],
                f"must be a list of rows in {path}")
        for k, r in enumerate(rows[name]):
            _numbers(r, len(terms) + 1, f"{where}.{name}[{k}]", path, "(features..., seconds)")
            require(r[-1] > 0, f"{where}.{name}[{k}]", r, f"a step time must be > 0 in {path}")
    return KeyEntry(raw["equation"], raw["mode"], raw["coefficients"], float(raw["margin"]),
                    rows["anchors"], rows["online"])


def _numbers(value: JsonValue, width: int, field: str, path: str | os.PathLike, names: str) -> None:
    """``value`` is a list of ``width`` finite numbers >= 0: coefficients, margins and step
    features are all non-negative."""
    require(isinstance(value, list) and len(value) == width, field, value,
            " ".join(f"must hold {width} numbers {names}".split()) + f" in {path}")
    for x in value:
        require(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
                and x >= 0, field, value, f"{x!r} is not a finite number >= 0 (in {path})")


def upgrade_v1_rows(rows: list[list[float]]) -> list[list[float]]:
    """Format 1 had no ζ term: its Equation I rows gain the feature (recomputable from T_in + B_d
    and T_ft) and its coefficients a ζ of 0, so a saved calibration predicts as it did."""
    return [[*r[:-1], r[1] if r[2] > 0 else 0.0, r[-1]] for r in rows]
