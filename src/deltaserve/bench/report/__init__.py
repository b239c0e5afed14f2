"""``report.html`` and its plots for one bench run."""

from __future__ import annotations

from pathlib import Path

from deltaserve.bench.outcome import SystemRun
from deltaserve.bench.report.page import page
from deltaserve.bench.report.plots import (
    plot_attainment,
    plot_latency,
    plot_loss,
    plot_sweep,
    plot_throughput,
)
from deltaserve.bench.results import BenchResults


def write_report(out: Path, results: BenchResults, runs: dict[str, SystemRun]) -> None:
    """``runs``: the replays behind ``results.main``, by system."""
    doc = results.as_json()
    slo = results.slo.config
    ordered = {n: runs[n] for n in results.main.scores}
    plot_latency(ordered, slo, out / "latency.png")
    plot_throughput(ordered, results.trace.trace, out / "throughput.png")
    plot_attainment(ordered, slo, out / "attainment.png")
    images = ["throughput.png", "latency.png", "attainment.png"]
    ds = runs.get("deltaserve")
    if ds is not None and ds.train_log and plot_loss(ds.train_log, out / "loss.png"):
        images.append("loss.png")
    if results.sweep:
        plot_sweep(results.sweep, out / "sweep.png")
    (out / "report.html").write_text(page(doc, images))
