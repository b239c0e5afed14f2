"""``report.html`` and its plots, in the style of the paper's figures."""

from __future__ import annotations

import html
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from deltaserve.bench.metrics import meets_slo
from deltaserve.bench.outcome import SystemRun
from deltaserve.core.slo import SLOConfig
from deltaserve.workloads.trace import Trace

COLUMNS = ("ft_tokens_per_s", "ft_samples_per_s", "slo_attainment", "ttft_p50_ms", "ttft_p99_ms",
           "tpot_p99_ms", "mean_e2e_s", "completed_requests", "latency_model_mape",
           "harvest_ratio")


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
    fig.savefig(path, dpi=110)
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
        ct = [c[0] - r.start_s for c in run.ft_commits]
        _, ft_rate = _binned(ct, [c[1] for c in run.ft_commits], end, bin_s)
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
    fig.savefig(path, dpi=110)
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
    ax.axhline(95, color="k", ls="--", lw=0.8, label="95 %")
    ax.set_ylim(0, 102)
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel(f"SLO attainment, last {window_s:.0f} s (%)")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def write_report(out: Path, results: dict, runs: dict[str, SystemRun], trace: Trace,
                 slo: SLOConfig) -> None:
    plot_latency(runs, slo, out / "latency.png")
    plot_throughput(runs, trace, out / "throughput.png")
    plot_attainment(runs, slo, out / "attainment.png")
    images = ["throughput.png", "latency.png", "attainment.png"]
    ds = runs.get("deltaserve")
    if ds is not None and ds.train_log and plot_loss(ds.train_log, out / "loss.png"):
        images.append("loss.png")
    rows = "".join(
        "<tr><td>" + html.escape(name) + "</td>"
        + "".join(f"<td>{_fmt(m.get(c))}</td>" for c in COLUMNS) + "</tr>"
        for name, m in results["systems"].items())
    head = "".join(f"<th>{c}</th>" for c in COLUMNS)
    tr = results["trace"]
    acc = results.get("heldout_accuracy")
    acc_html = "" if not acc else (
        f"<p>Held-out exact-match accuracy of the adapter trained by <b>deltaserve</b>: "
        f"before {acc['before']:.1%}, after {acc.get('after', float('nan')):.1%}.</p>")
    cal = "".join(f"<li>{c['equation']} / {c['mode']}: {c['points']} probes, in-sample MAPE "
                  f"{c['mape']:.1%}, R² {c['r2']:.3f}</li>" for c in results["calibration"])
    doc = f"""<!doctype html><html><head><meta charset="utf-8"><title>DeltaServe benchmark</title>
<style>body{{font-family:sans-serif;max-width:1150px;margin:auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 6px;font-size:13px}}img{{max-width:100%}}</style>
</head><body><h1>DeltaServe benchmark</h1>
<p>Trace <b>{html.escape(tr['name'])}</b>: {tr['requests']} requests over
{tr['duration_s']:.0f} s, peak {tr['peak_rps']:.2f} req/s, mean {tr['mean_rps']:.2f} req/s
(rate ×{tr['rate_factor']:.4g}, lengths ×{tr['length_scale']}). SLO: TTFT
{results['slo']['ttft_ms']:.0f} ms, max TPOT {results['slo']['tpot_ms']:.0f} ms per request.
Model {html.escape(results['machine']['model'])} on the {html.escape(results['machine']['host'])}
host, {results['machine']['threads']} threads. Standalone training of the whole machine:
{results['standalone_training_tokens_per_s']:.1f} tokens/s; the inference-only run left the
machine idle {_fmt(results['inference_only_idle_fraction'])} of the time.</p>
<table><tr><th>system</th>{head}</tr>{rows}</table>
{acc_html}
<p>Definitions: a request meets its SLO when its TTFT (from its scheduled arrival) and its
longest gap between tokens are within the objectives; <code>tpot_p99_ms</code> is the 99th
percentile of that longest gap; fine-tuning throughput counts tokens the backward committed
during the run; the harvest ratio divides it by standalone throughput × idle fraction; the
latency-model MAPE is out-of-sample, over steps longer than 20 ms.</p>
<h2>Start-up calibration</h2><ul>{cal}</ul>
{''.join(f'<h2>{html.escape(i[:-4])}</h2><img src="{i}">' for i in images)}
</body></html>"""
    (out / "report.html").write_text(doc)
