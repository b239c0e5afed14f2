"""Real traces: Azure LLM inference CSV, Mooncake JSONL, BurstGPT CSV.

* Azure (``TIMESTAMP, ContextTokens, GeneratedTokens``; timestamps like
  ``2023-11-16 18:17:03.9799600``);
* Mooncake JSONL (``timestamp`` in ms, ``input_length``, ``output_length``);
* BurstGPT CSV (``Timestamp`` in s, ``Request tokens``, ``Response tokens``; a response of 0
  tokens is a failed request and is left out, counted).

Times are re-based so the first request arrives at 0. A malformed row raises
:class:`InputError` with its line number.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from deltaserve.core.errors import InputError
from deltaserve.workloads.synthetic import SYNTHETIC, generate
from deltaserve.workloads.trace import Trace, from_arrivals


@dataclass(frozen=True)
class LoadReport:
    rows: int
    kept: int
    dropped_failed: int


def _parse_time(text: str, line: int) -> float:
    text = text.strip()
    if "." in text:  # datetime handles at most 6 fractional digits
        head, frac = text.split(".", 1)
        text = f"{head}.{frac[:6]}"
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError as e:
        raise InputError("TIMESTAMP", text, f"not a timestamp: {e}", line=line) from None


def _int(row: dict, key: str, line: int) -> int:
    try:
        return int(float(row[key]))
    except (KeyError, TypeError, ValueError):
        raise InputError(key, row.get(key), "missing or not a number", line=line) from None


def _finish(name: str, times: list[float], prompts: list[int], outputs: list[int],
            source: str) -> Trace:
    if not times:
        raise InputError("trace", name, "holds no requests")
    t0 = min(times)
    rel = [t - t0 for t in times]
    duration = max(rel) + 1e-3
    return from_arrivals(name, rel, [max(1, p) for p in prompts], [max(1, o) for o in outputs],
                         duration, source)


def load_azure(path: str | os.PathLike) -> tuple[Trace, LoadReport]:
    times, prompts, outputs = [], [], []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if not need <= set(reader.fieldnames or ()):
            raise InputError("columns", reader.fieldnames, f"an Azure trace has {sorted(need)}")
        for line, row in enumerate(reader, start=2):
            times.append(_parse_time(row["TIMESTAMP"], line))
            prompts.append(_int(row, "ContextTokens", line))
            outputs.append(_int(row, "GeneratedTokens", line))
    trace = _finish(Path(path).stem, times, prompts, outputs, "azure")
    return trace, LoadReport(len(times), len(times), 0)


def load_mooncake(path: str | os.PathLike) -> tuple[Trace, LoadReport]:
    times, prompts, outputs = [], [], []
    with open(path) as f:
        for line, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except json.JSONDecodeError as e:
                raise InputError("json", raw[:40], f"not valid JSON: {e.msg}", line=line) from None
            times.append(_int(row, "timestamp", line) / 1000.0)
            prompts.append(_int(row, "input_length", line))
            outputs.append(_int(row, "output_length", line))
    trace = _finish(Path(path).stem, times, prompts, outputs, "mooncake")
    return trace, LoadReport(len(times), len(times), 0)


def load_burstgpt(path: str | os.PathLike) -> tuple[Trace, LoadReport]:
    times, prompts, outputs = [], [], []
    rows = failed = 0
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        need = {"Timestamp", "Request tokens", "Response tokens"}
        if not need <= set(reader.fieldnames or ()):
            raise InputError("columns", reader.fieldnames, f"a BurstGPT trace has {sorted(need)}")
        for line, row in enumerate(reader, start=2):
            rows += 1
            out = _int(row, "Response tokens", line)
            if out == 0:
                failed += 1
                continue
            times.append(float(row["Timestamp"]))
            prompts.append(_int(row, "Request tokens", line))
            outputs.append(out)
    trace = _finish(Path(path).stem, times, prompts, outputs, "burstgpt")
    return trace, LoadReport(rows, rows - failed, failed)


def load_trace(name_or_path: str, *, seed: int = 0, duration_s: float | None = None) -> Trace:
    """A synthetic trace by name, or a real one from a file (format from its columns)."""
    if name_or_path in SYNTHETIC:
        return generate(name_or_path, seed=seed, duration_s=duration_s)
    path = Path(name_or_path)
    if not path.is_file():
        raise InputError("trace", name_or_path,
                         f"neither a synthetic trace ({', '.join(SYNTHETIC)}) nor a file")
    if path.suffix in (".jsonl", ".json"):
        trace, _ = load_mooncake(path)
    else:
        header = path.open().readline()
        trace, _ = load_burstgpt(path) if "Request tokens" in header else load_azure(path)
    return trace
