"""``summary.md`` and ``calibration.json`` of a device bench: every stage's numbers on one page
(``scripts/device_bench.sh`` runs it last, through ``device_bench.py summarize``)."""

from __future__ import annotations

import glob
import json
from pathlib import Path

from deltaserve.core.latency_model import LatencyModel

BENCH_FILES = {"bench_paper_slo.json": "at the paper's A100 SLO (TTFT 400 ms, TPOT 120 ms)",
               "bench_derived_slo.json": "at the SLO derived from the pilot (2 x its p99s)"}


def calibration_quality(bench_work: Path) -> list[dict]:
    """In-sample MAPE and R² per (equation, mode) of the latency model a bench calibrated."""
    files = sorted(glob.glob(str(bench_work / "latency_model_*t.json")))
    if not files:
        return []
    return [{"equation": q.equation.value, "mode": q.mode.value, "points": q.num_points,
             "mape": round(q.mape, 4), "r2": round(q.r2, 4)}
            for q in LatencyModel.load(files[-1]).quality()]


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _table(head: list[str], rows: list[list[object]]) -> list[str]:
    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
        return "" if v is None else str(v)

    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows] + [""])


ENGINE_HEAD = ["shape", "mode", "median ms", "p90 ms", "H200 floor ms", "x floor",
               "engine 2b6c3af ms"]
ENGINE_KEYS = ["shape", "mode", "median_ms", "p90_ms", "h200_floor_ms", "x_floor",
               "h200_engine_2b6c3af_ms"]
BENCH_HEAD = ["system", "FT tokens/s", "SLO attainment", "TTFT p99 ms", "TPOT p99 ms",
              "requests"]
BENCH_KEYS = ["ft_tokens_per_s", "slo_attainment", "ttft_p99_ms", "tpot_p99_ms",
              "completed_requests"]


def _engine(doc: dict | None) -> list[str]:
    if doc is None:
        return ["Not measured (the stage failed or ran out of time; see the log).", ""]
    where = doc["env"].get("gpu") or "cpu"
    intro = (f"{doc['model']} on {doc['device']} ({where}); the floor and the engine at "
             f"2b6c3af are from {doc['floor_source']}.")
    return [intro, "", *_table(ENGINE_HEAD, [[r[k] for k in ENGINE_KEYS] for r in doc["rows"]])]


def _backward(doc: dict | None) -> list[str]:
    if doc is None:
        return ["Not measured (see the log).", ""]
    return _table(["FT tokens/s", "batches", "failed", "step ms (median)", "H200 floor"],
                  [[doc["backward_tokens_per_s"], doc["batches"], doc["backward_failures"],
                    doc["backward_step_ms_median"], doc["h200_floor_tokens_per_s"]]])


def _bench(name: str, doc: dict | None) -> list[str]:
    if doc is None:
        return [f"### {BENCH_FILES[name]}", "", "Not run to the end (see the log).", ""]
    rows = [[n, *(s[k] for k in BENCH_KEYS)] for n, s in doc["systems"].items()]
    return [f"### {BENCH_FILES[name]}", "", doc["slo"]["text"], "", *_table(BENCH_HEAD, rows)]


def summarize(out: Path, bench_work: list[Path], stages: Path | None) -> None:
    """Write ``calibration.json`` and ``summary.md`` into ``out`` from the stages' files."""
    quality = next((q for q in map(calibration_quality, bench_work) if q), [])
    (out / "calibration.json").write_text(json.dumps(quality, indent=1))
    lines = ["# Device bench", ""]
    if stages is not None and stages.is_file():
        rows = [ln.split("\t") for ln in stages.read_text().splitlines() if ln.strip()]
        lines += ["## Stages", "", *_table(["stage", "exit", "seconds"], rows)]
    lines += ["## The engine against the plain-PyTorch floor", ""]
    lines += _engine(_load(out / "engine.json"))
    lines += ["## The backward", "", *_backward(_load(out / "backward.json"))]
    lines += ["## Calibration (in-sample, per equation and mode)", ""]
    lines += _table(["equation", "mode", "probes", "MAPE", "R²"],
                    [[q["equation"], q["mode"], q["points"], q["mape"], q["r2"]]
                     for q in quality]) if quality else ["No calibration saved.", ""]
    lines += ["## The bench", ""]
    for name in BENCH_FILES:
        lines += _bench(name, _load(out / name))
    (out / "summary.md").write_text("\n".join(lines))
