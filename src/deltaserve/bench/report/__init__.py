"""``report.html`` and its plots for one bench run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from deltaserve.bench.outcome import SystemRun
from deltaserve.bench.report.page import page
from deltaserve.bench.results import BenchResults, SweepPoint
from deltaserve.core.slo import SLOConfig
from deltaserve.workloads.trace import Trace

try:  # matplotlib is optional where only the numbers are wanted (a GPU machine without it)
    from deltaserve.bench.report import plots
except ModuleNotFoundError as e:
    if e.name != "matplotlib":
        raise
    plots = None


def write_report(out: Path, results: BenchResults, runs: dict[str, SystemRun]) -> None:
    """``runs``: the replays behind ``results.main``, by system."""
    write_pages(out, results.as_json(), {n: runs[n] for n in results.main.scores},
                results.slo.config, results.trace.trace, results.sweep)


def write_pages(out: Path, doc: dict, runs: dict[str, SystemRun], slo: SLOConfig,
                trace: Trace, sweep: Sequence[SweepPoint] = ()) -> None:
    """The report of ``doc`` (a ``results.json``) and its plots; ``runs`` in report order. A
    host that replays its own way (the simulated host) writes its report through this. Without
    matplotlib the page has no plots."""
    images = _plots(out, runs, slo, trace, sweep) if plots is not None else []
    (out / "report.html").write_text(page(doc, images))


def _plots(out: Path, runs: dict[str, SystemRun], slo: SLOConfig, trace: Trace,
           sweep: Sequence[SweepPoint]) -> list[str]:
    assert plots is not None
    plots.plot_latency(runs, slo, out / "latency.png")
    plots.plot_throughput(runs, trace, out / "throughput.png")
    plots.plot_attainment(runs, slo, out / "attainment.png")
    images = ["throughput.png", "latency.png", "attainment.png"]
    ds = runs.get("deltaserve")
    if ds is not None and ds.train_log and plots.plot_loss(ds.train_log, out / "loss.png"):
        images.append("loss.png")
    if sweep:
        plots.plot_sweep(list(sweep), out / "sweep.png")
    return images
