"""Every step of a run, as JSON lines under ``<out>/work/steps/`` (one file per run): the shape,
the measured seconds, what the latency model predicted just before it (where it kept it) and
whether a yield preceded it. Not scored: the raw material for finding where the latency model's
error comes from (:mod:`deltaserve.bench.latency_terms` refits it on these with other terms)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

from deltaserve.core.contract import StepRecord
from deltaserve.core.shape import ExecMode, StepShape


def step_row(step: StepRecord, predicted_s: float | None) -> dict:
    """One step as a JSON object: its shape's fields, seconds, prediction, yield."""
    shape = {**asdict(step.shape), "mode": step.shape.mode.value}
    return {"t_s": step.t_s, "seconds": step.seconds, "predicted_s": predicted_s,
            "ft_tokens": step.ft_tokens, "aborted": step.aborted, "yielded_s": step.yielded_s,
            "hooks_s": step.hooks_s, "span_s": step.span_s, "gc_s": step.gc_s,
            "shape": shape}


def shape_of(row: Mapping) -> StepShape:
    """The shape of a row written by :func:`step_row`."""
    s = row["shape"]
    return StepShape(tuple(s["prefill_lens"]), s["num_decode"], s["kv_tokens"],
                     tuple(s["ft_lens"]), ExecMode(s["mode"]), tuple(s["prefill_prefix_lens"]),
                     s["after_yield"])


def write_steps(path: Path, steps: Sequence[StepRecord],
                predicted: Mapping[tuple[StepShape, float], float]) -> Path:
    """Write ``steps`` (with their predictions by (shape, seconds)) to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for step in steps:
            f.write(json.dumps(step_row(step, predicted.get((step.shape, step.seconds)))) + "\n")
    return path


def read_json_lines(path: Path) -> list[dict]:
    """The rows of a JSON-lines log (gzip-compressed where its name ends in ``.gz``, as
    committed): a step log, or a trainer's ``train_log.jsonl``."""
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" \
        else path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


read_steps = read_json_lines  # the rows of a step log


def host_s(row: Mapping) -> float | None:
    """The seconds of a step's span that were neither its forward nor the yield before it
    (``None`` where the host did not measure its span)."""
    span_s = row.get("span_s", 0.0)
    return span_s - row["seconds"] - row["yielded_s"] if span_s > 0 else None
