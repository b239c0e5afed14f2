"""The report's plots, in the style of the paper's figures (small PNGs: they are committed)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from deltaserve.bench.metrics import meets_slo
from deltaserve.bench.outcome import SystemRun
from deltaserve.bench.results import SweepPoint
from deltaserve.bench.score import MET
from deltaserve.core.slo import SLOConfig
from deltaserve.workloads.trace import Trace

DPI = 80


def _binned(times: list[float], weights: list[float], t_end: float, bin_s: float
            ) -> tuple[np.ndarray, np.ndarray]:
    edges = np.arange(0, max(t_end, bin_s) + bin_s, bin_s)
    hist, _ = np.histogram(times, bins=edges, weights=weights)
    return edges[:-1], hist / bin_s


def plot_latency(runs: dict[str, SystemRun], slo: SLOConfig, path: Path) -> None:
    fig, axes = plt.subplots(len(runs), 2, figsize=(11, 2.2 * len(runs)), sharex=True,
                             squeeze=False)
    for row, (name, run) in enumerate(runs.items()):
        recs = run.result.records
        t = [r.scheduled_s - run.result.start_s for r in recs]
        ok = [meets_slo(r, slo) for r in recs]
        ttft = [r.ttft_s if r.ttft_s is not None else np.nan for r in recs]
        tpot = [r.max_tpot_s for r in recs]
        for col, (vals, limit, label) in enumerate(((ttft, slo.ttft_s, "TTFT (s)"),
                                                     (tpot, slo.tpot_s, "max TPOT (s)"))):
            ax = axes[row][col]
            ax.scatter(t, vals, s=6, c=["tab:blue" if k else "tab:red" for k in ok])
            ax.axhline(limit, color="k", ls="--", lw=0.8)
            ax.set_ylabel(label)
            ax.set_title(f"{name}", fontsize=9, loc="left")
    for ax in axes[-1]:
        ax.set_xlabel("arrival time (s)")
    fig.suptitle("Per-request latency (red: SLO missed; dashed: objective)")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_throughput(runs: dict[str, SystemRun], trace: Trace, path: Path,
                    bin_s: float = 2.0) -> None:
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.1 * len(runs)), sharex=True,
                             squeeze=False)
    for ax, (name, run) in zip(axes[:, 0], runs.items(), strict=True):
        r = run.result
        end = r.wall_s
        st = [s.t_s - r.start_s for s in r.steps if not s.aborted]
        inf_tok = [s.shape.num_prefill_tokens + s.shape.num_decode for s in r.steps
                   if not s.aborted]
        x, inf_rate = _binned(st, inf_tok, end, bin_s)
        ct = [c.at_s - r.start_s for c in run.commits]
        _, ft_rate = _binned(ct, [c.num_tokens for c in run.commits], end, bin_s)
        ax.stackplot(x, inf_rate, ft_rate, labels=("inference tokens/s",
                                                   "fine-tuning tokens/s (committed)"),
                     colors=("tab:blue", "tab:orange"), alpha=0.8, step="post")
        ax.set_ylabel("tokens/s")
        ax.set_title(name, fontsize=9, loc="left")
        twin = ax.twinx()
        tx, rate = _binned([q.arrival_s for q in trace.requests],
                           [1.0] * len(trace), trace.duration_s, bin_s)
        twin.step(tx, rate, where="post", color="k", lw=0.8)
        twin.set_ylabel("arrivals/s", fontsize=8)
    axes[0, 0].legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("time (s)")
    fig.suptitle("Throughput: fine-tuning stacked on inference (black: request arrivals)")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_attainment(runs: dict[str, SystemRun], slo: SLOConfig, path: Path,
                    window_s: float = 10.0) -> None:
    fig, ax = plt.subplots(figsize=(11, 3.2))
    for name, run in runs.items():
        recs = sorted(run.result.records, key=lambda r: r.scheduled_s)
        t = np.array([r.scheduled_s - run.result.start_s for r in recs])
        ok = np.array([meets_slo(r, slo) for r in recs], dtype=float)
        if not len(t):
            continue
        roll = [ok[(t > x - window_s) & (t <= x)].mean() for x in t]
        ax.plot(t, np.array(roll) * 100, label=name, lw=1.2)
    ax.axhline(MET * 100, color="k", ls="--", lw=0.8, label=f"{MET:.0%}")
    ax.set_ylim(0, 102)
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel(f"SLO attainment, last {window_s:.0f} s (%)")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_loss(train_log: str, path: Path) -> bool:
    p = Path(train_log)
    if not p.is_file():
        return False
    rows = [json.loads(x) for x in p.read_text().splitlines()]
    rows = [r for r in rows if r.get("event") == "OptimizerStep"]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker=".")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (response tokens)")
    ax.set_title("deltaserve: training loss")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def plot_sweep(points: list[SweepPoint], path: Path) -> None:
    """Fine-tuning tokens/s against SLO attainment, one curve per system, a point per SLO
    scale (labelled): the most fine-tuning at full attainment is a policy's worth."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    names = list(points[0].scores) if points else []
    for name in names:
        xs = [p.scores[name].metrics.slo_attainment * 100 for p in points]
        ys = [p.scores[name].metrics.ft_tokens_per_s for p in points]
        line, = ax.plot(xs, ys, marker="o", lw=1.2, label=name)
        for p, x, y in zip(points, xs, ys, strict=True):
            ax.annotate(f"×{p.slo.scale:g}", (x, y), fontsize=7, color=line.get_color(),
                        textcoords="offset points", xytext=(3, 3))
    ax.axvline(MET * 100, color="k", ls="--", lw=0.8)
    ax.set_xlabel("SLO attainment (%)  [label: SLO scale × the pilot's p99s]")
    ax.set_ylabel("fine-tuning tokens/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
