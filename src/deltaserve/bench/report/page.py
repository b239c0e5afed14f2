"""``report.html``: the run's tables (from the same JSON as ``results.json``), what each number
means, and the plots."""

from __future__ import annotations

import html
from collections.abc import Sequence

from deltaserve.bench.tables import COLUMNS, system_row

HARVEST_TEXT = """Harvest ratio, in core-seconds (device-seconds on a GPU), over the one window
every system is scored in: fine-tuning tokens the system committed in it ÷ ((the pilot's idle
core-seconds in it + the core-seconds the system reserved for training in it) × the standalone
trainer's tokens per core-second). Cores are the machine's
threads. The pilot (inference-only on every core) scores 0 by construction. 1 means the system
trained as much as a standalone trainer could have in the capacity charged to it. Above 1 means
it trained more than that: training rows rode inside inference steps at a marginal cost below a
standalone trainer's (capacity this account does not call idle), its training ran on fewer
cores than the standalone measurement where threads scale sub-linearly, or it slowed inference
without reserving cores, which its SLO attainment then shows."""

LATENCY_TEXT = """Latency-model error, per execution mode, over steps of at least {min_ms:g} ms:
<i>online</i>, each step predicted just before the model learned from it; <i>held out</i>,
every k-th served step (k = {k}) predicted with the model of that moment and never learned
from. The table's single value pools the modes (step-weighted)."""


def _table(head: Sequence[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f} %"


def _latency_rows(doc: dict) -> list[list[str]]:
    return [[name, e["mode"], f"{_pct(e['online_mape'])} ({e['online_steps']})",
             f"{_pct(e['heldout_mape'])} ({e['heldout_steps']})"]
            for name, s in doc["systems"].items() for e in s["latency_model_by_mode"]]


def _share_text(doc: dict) -> str:
    shares = {n: s["hardware_share"] for n, s in doc["systems"].items()}
    parts = [f"{n}: host {v['host']}" + (f" + training {v['reserved']}" if v["reserved"]
                                         else " (training, if any, shares them)")
             for n, v in shares.items()]
    m = doc["machine"]
    whole = (f"{doc['harvest']['cores']} simulated {m['gpu']} GPUs" if m.get("gpu")
             else f"{m['threads']} threads")
    return (f"Every system had the whole machine, {whole}: "
            + "; ".join(parts) + ".")


def _padding_text(doc: dict) -> str:
    eff = {n: s["padded_token_efficiency"] for n, s in doc["systems"].items()
           if s["padded_token_efficiency"] is not None}
    if not eff:
        return ""
    items = ", ".join(f"{n} {v:.1%}" for n, v in eff.items())
    return (f"<p>Padded-token efficiency (committed tokens ÷ tokens computed with padding): "
            f"{html.escape(items)}. DeltaServe's backward runs packed rows; split-pool's trainer "
            f"takes samples in the same order and batches, padded to each batch's longest.</p>")


def _sweep_html(doc: dict) -> str:
    points = doc.get("sweep") or []
    if not points:
        return ""
    head = ["system", *(f"×{p['scale']:g} (TTFT {p['slo']['ttft_ms']:.0f} / TPOT "
                        f"{p['slo']['tpot_ms']:.0f} ms)" for p in points)]
    rows = [[n, *(f"{p['systems'][n]['ft_tokens_per_s']:.0f} tok/s, "
                  f"{_pct(p['systems'][n]['slo_attainment'])}" for p in points)]
            for n in points[0]["systems"]]
    return ("<h2>SLO sweep: fine-tuning against SLO attainment</h2>" + _table(head, rows)
            + '<p>SLO-aware systems ran once per scale; the others ran once and are scored '
              'against each scale\'s SLO.</p><img src="sweep.png">')


def _late_events_html(doc: dict) -> str:
    """Every missed request's late events, per system: what the late span held."""
    rows = [[n, str(e["repeat"] + 1), str(e["request"]), e["event"], f"{e['late_ms']:.0f}",
             f"{e['span_s']:.2f}", str(e["steps"]), f"{e['step_s']:.2f}",
             f"{e['yielded_s']:.2f}", str(e["ft_tokens"]), f"{e['other_s']:.2f}",
             "–" if e.get("predicted_s") is None else f"{e['predicted_s']:.2f}",
             html.escape(e.get("longest", ""))]
            for n, s in doc["systems"].items() for e in (s.get("misses") or {}).get("events", [])]
    if not rows:
        return ""
    head = ("system", "repeat", "request", "event", "late (ms)", "span (s)", "steps",
            "in steps (s)", "lent before them (s)", "FT tokens", "other (s)",
            "predicted (s)", "longest step")
    return ("<h2>Missed requests</h2><p>Each late event's span (arrival to first token, or the "
            "longest gap between tokens) and what it held: the steps that ended in it, the "
            "time lent to the backward before them, the fine-tuning tokens they carried, and "
            "the rest (waits for the backward to stop, scheduling, idle); then what the "
            "latency model predicted for those steps, and the longest one's tokens.</p>"
            + _table(head, rows))


def _replicas_html(doc: dict) -> str:
    """With ``--replicas``: every system's replicas, their totals and the all-reduce time."""
    fleet = doc.get("replicas")
    if not fleet:
        return ""
    rows = []
    for name, f in fleet["systems"].items():
        reduce_ms = ("–" if f["allreduce_s_median"] is None else
                     f"{f['allreduce_s_median'] * 1e3:.1f} / {f['allreduce_s_p90'] * 1e3:.1f}")
        for r in f["replicas"]:
            rows.append([name, str(r["rank"]), str(r["requests"]),
                         f"{r['ft_tokens_per_s']:.1f}", _pct(r["slo_attainment"]), ""])
        rows.append([name, "total", str(sum(r["requests"] for r in f["replicas"])),
                     f"{f['ft_tokens_per_s']:.1f}", _pct(f["slo_attainment"]), reduce_ms])
    head = ("system", "replica", "requests", "FT tokens/s", "SLO attainment",
            "all-reduce per step, median / p90 (ms)")
    return (f"<h2>Replicas</h2><p>{fleet['count']} data-parallel replicas of "
            f"{fleet['threads_per_replica']} thread(s) each, requests routed "
            f"{html.escape(fleet['router'])}, one adapter trained by all (gradients "
            f"all-reduced every optimizer step; its time includes waiting for the slowest "
            f"replica). Main scale, repeat {fleet['repeat']}.</p>" + _table(head, rows))


def _window_text(doc: dict) -> str:
    w = doc.get("window_s")
    if w is None:
        return "each system's own replay"
    return (f"one {w:.0f}-s window, the same for every system (the trace and a "
            f"{doc['drain_s']:g}-s drain; later commits do not count, every request's latency "
            f"does)")


def _provenance_html(doc: dict) -> str:
    p = doc.get("provenance")
    if not p:
        return ""
    versions = ", ".join(f"{k} {v}" for k, v in p["versions"].items() if v)
    dirty = {True: " with uncommitted changes", False: "", None: ""}[doc.get("dirty")]
    return (f"<p>Run at commit <code>{html.escape(str(doc.get('commit')))}</code>{dirty}: "
            f"<code>{html.escape(' '.join(p['argv']))}</code>; {html.escape(versions)}; "
            f"{p['cores']} cores, GPU {html.escape(str(p['gpu']))}.</p>")


def page(doc: dict, images: list[str]) -> str:
    t, slo = doc["trace"], doc["slo"]
    h = doc["harvest"]
    acc = doc.get("heldout_accuracy")
    acc_html = "" if not acc else (
        f"<p>Held-out exact-match accuracy of the adapter trained by <b>{acc['system']}</b>: "
        f"before {acc['before']:.1%}, after "
        f"{'–' if acc['after'] is None else format(acc['after'], '.1%')}.</p>")
    comps = [[f"{c['system']} / {c['baseline']}",
              "–" if c["ft_ratio"] is None else f"{c['ft_ratio']:.2f}×",
              f"{_pct(c['system_attainment'])} / {_pct(c['baseline_attainment'])}"]
             for c in doc["comparisons"]]
    cal = "".join(f"<li>{c['equation']} / {c['mode']}: {c['points']} probes, in-sample MAPE "
                  f"{c['mape']:.1%}, R² {c['r2']:.3f}</li>" for c in doc["calibration"])
    k = doc["config"]["latency_holdout_every"]
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>DeltaServe benchmark</title>
<style>body{{font-family:sans-serif;max-width:1150px;margin:auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 6px;font-size:13px}}img{{max-width:100%}}</style>
</head><body><h1>DeltaServe benchmark</h1>
<p>Trace <b>{html.escape(t['name'])}</b>: {t['requests']} requests over {t['duration_s']:.0f} s,
peak {t['peak_rps']:.2f} req/s, mean {t['mean_rps']:.2f} req/s (rate ×{t['rate_factor']:.4g},
lengths ×{t['length_scale']}). Model {html.escape(doc['machine']['model'])} on the
{html.escape(doc['machine']['host'])} host. {html.escape(_share_text(doc))}</p>
<p><b>SLO</b>: {html.escape(slo['text'])}. The pilot is inference-only on the trace, run first.
<br><b>{html.escape(doc['slo_binding']['verdict'].capitalize())}.</b></p>
{_table(COLUMNS, [system_row(n, s, doc['systems']) for n, s in doc['systems'].items()])}
<p>Each system is listed beside its pair (the system it differs from in one thing);
<i>× pair</i> is its fine-tuning tokens/s over its pair's.</p>
{_table(('comparison', 'FT tokens/s ratio', 'SLO attainment'), comps)}
{acc_html}
<p>Definitions: a request meets its SLO when its TTFT (from its scheduled arrival) and its
longest gap between tokens are within the objectives; a system meets the SLO at ≥ 99 %
attainment; TPOT p99 is the 99th percentile of that longest gap; fine-tuning throughput counts
tokens the backward committed in {_window_text(doc)}; end-to-end latency runs from a
request's scheduled arrival to its last token.</p>
<p>{HARVEST_TEXT} Here: {h['cores']} cores, the pilot left {h['idle_core_s']:.1f} of
{h.get('total_core_s', h['cores'] * h['pilot_wall_s']):.1f} core-seconds idle; standalone training
{h['standalone_tokens_per_s']:.1f} tokens/s on {h['standalone_cores']} cores.</p>
{_padding_text(doc)}
<p>{LATENCY_TEXT.format(k=k, min_ms=doc['config']['latency_error_min_ms'])}</p>
{_table(('system', 'mode', 'online MAPE (steps)', 'held-out MAPE (steps)'), _latency_rows(doc))}
{_replicas_html(doc)}
{_late_events_html(doc)}
{_sweep_html(doc)}
<h2>Start-up calibration</h2><ul>{cal}</ul>
{_provenance_html(doc)}
{''.join(f'<h2>{html.escape(i[:-4])}</h2><img src="{i}">' for i in images)}
</body></html>"""
