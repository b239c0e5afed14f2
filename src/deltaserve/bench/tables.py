"""The README's result tables, rendered from a committed ``results.json``.

A README block between ``<!-- results: PATH -->`` and ``<!-- /results -->`` (PATH: the
``results.json``, relative to the README's folder) holds exactly :func:`render` of that file;
one between ``<!-- results-summary: PATH -->`` and ``<!-- /results-summary -->`` holds
:func:`summary`, the run's figures as prose (the README's prose states a run's numbers only in
such blocks, so none of them can drift from the file). One between
``<!-- hosts-parity: DIR DIR ... -->`` and ``<!-- /hosts-parity -->`` holds every host's run
side by side with the goal's verdicts (:mod:`deltaserve.bench.parity`).
``tests/bench/test_readme_results.py`` and ``tests/bench/test_parity.py`` check every such
block; this module rewrites them::

    python -m deltaserve.bench.tables results/2026-12-10-native-burst-light/results.json
    python -m deltaserve.bench.tables --update README.md
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deltaserve.bench import parity

BLOCK = re.compile(r"(?P<open><!-- results(?P<kind>(?:-summary)?): (?P<path>\S+) -->\n)"
                   r"(?P<body>.*?)(?P<close><!-- /results(?P=kind) -->)", re.S)
PARITY = re.compile(r"(?P<open><!-- hosts-parity: (?P<path>[^\n]+?) -->\n)(?P<body>.*?)"
                    r"(?P<close><!-- /hosts-parity -->)", re.S)
PILOT = "inference-only"
COLUMNS = ("system", "pair", "FT tokens/s", "× pair", "SLO attainment", "TTFT p50 / p99 (ms)",
           "TPOT p99 (ms)", "E2E mean / p95 (s)", "E2E ÷ inference-only mean / p95", "harvest",
           "latency MAPE online / held-out", "cores host + training")


def _num(v: float | None, fmt: str, unit: str = "") -> str:
    return "–" if v is None else f"{v:{fmt}}{unit}"


def _pct(v: float | None) -> str:
    return _num(None if v is None else 100 * v, ".1f", " %")


def _ranged(s: dict, key: str, fmt: str, unit: str = "", scale: float = 1.0) -> str:
    """``s[key]``, and where the run was repeated its range: "108 (101–112)" (the median, then
    min–max over the repeats)."""
    v = s.get(key)
    text = _num(None if v is None else scale * v, fmt, unit)
    r = (s.get("range") or {}).get(key)
    if r is None or v is None:
        return text
    return f"{text} ({r[0] * scale:{fmt}}–{r[1] * scale:{fmt}})"


def _ratio(v: float | None, ref: float | None) -> float | None:
    return v / ref if v is not None and ref else None


def e2e_ratios(name: str, systems: dict) -> tuple[float | None, float | None]:
    """Mean and p95 end-to-end latency ÷ inference-only's: the results' own figures, or for a
    results file from before they were recorded, computed from its latencies (None where one is
    missing)."""
    s, base = systems[name], systems.get(PILOT, {})
    if "e2e_mean_vs_inference_only" in s:
        return s["e2e_mean_vs_inference_only"], s.get("e2e_p95_vs_inference_only")
    return (_ratio(s.get("mean_e2e_s"), base.get("mean_e2e_s")),
            _ratio(s.get("e2e_p95_s"), base.get("e2e_p95_s")))


def _pooled(by_mode: list[dict], key: str) -> float | None:
    rows = [m for m in by_mode if m[f"{key}_mape"] is not None and m[f"{key}_steps"]]
    n = sum(m[f"{key}_steps"] for m in rows)
    return sum(m[f"{key}_mape"] * m[f"{key}_steps"] for m in rows) / n if n else None


def system_row(name: str, s: dict, systems: dict) -> list[str]:
    pair = s.get("pair")
    ft = s["ft_tokens_per_s"]
    other = systems.get(pair, {}).get("ft_tokens_per_s") if pair else None
    by_mode = s["latency_model_by_mode"]
    share = s["hardware_share"]
    e2e_mean, e2e_p95 = e2e_ratios(name, systems)
    return [name, pair or "–", _ranged(s, "ft_tokens_per_s", ".0f"),
            _num(ft / other if other else None, ".2f", "×"),
            _ranged(s, "slo_attainment", ".1f", " %", 100),
            f"{_ranged(s, 'ttft_p50_ms', '.0f')} / {_ranged(s, 'ttft_p99_ms', '.0f')}",
            _ranged(s, "tpot_p99_ms", ".0f"),
            f"{_ranged(s, 'mean_e2e_s', '.2f')} / {_ranged(s, 'e2e_p95_s', '.2f')}",
            f"{_num(e2e_mean, '.2f', '×')} / {_num(e2e_p95, '.2f', '×')}",
            _ranged({"h": s["harvest"]["ratio"],
                     "range": {"h": (s.get("range") or {}).get("harvest_ratio")}}, "h", ".2f"),
            f"{_pct(_pooled(by_mode, 'online'))} / {_pct(_pooled(by_mode, 'heldout'))}",
            f"{share['host']} + {share['reserved']}"]


def _table(head: Sequence[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(r) + " |" for r in rows)]


def _sweep(doc: dict) -> list[str]:
    points = doc.get("sweep") or []
    if not points:
        return []
    head = ["system", *(f"×{p['scale']:g}: FT tokens/s (SLO)" for p in points)]
    rows = [[name, *(f"{_num(p['systems'][name]['ft_tokens_per_s'], '.0f')} "
                     f"({_pct(p['systems'][name]['slo_attainment'])})" for p in points)]
            for name in points[0]["systems"]]
    return ["", "SLO sweep (scale × the pilot's p99s):", "", *_table(head, rows)]


def _where(m: dict) -> str:
    """The host and its hardware (a simulated host names its GPUs; cores are then GPUs)."""
    if m.get("gpu"):
        return f"{m['replicas']}× {m['gpu']} on the {m['host']} host (cores below are GPUs)"
    return f"{m['model']} on the {m['host']} host, {m['threads']} threads"


def _window(doc: dict) -> str:
    """How fine-tuning was counted, and over how many repeats (nothing for a results file from
    before the window, whose rates are over each system's own wall time)."""
    if doc.get("window_s") is None:
        return "Fine-tuning counted over each system's own replay (no common window). "
    n = doc.get("repeats") or 1
    reps = (f" Each system ran {n} times, interleaved: medians, with the range (min–max) in "
            f"brackets." if n > 1 else "")
    return (f"Fine-tuning counted in one {doc['window_s']:.0f}-s window for every system (the "
            f"trace and a {doc['drain_s']:g}-s drain).{reps} ")


def _comparison_ratio(c: dict) -> str:
    text = _num(c["ft_ratio"], ".2f", "×")
    return text + (" (within the repeats' range)" if c.get("within_range") else "")


def _reference(doc: dict) -> list[str]:
    """The run beside published numbers, where the results hold such a comparison."""
    ref = doc.get("paper")
    if not ref:
        return []
    return ["", f"Beside the paper ({ref['setting']}):", "",
            *_table(("quantity", "paper", "this run"), ref["rows"])]


def render(doc: dict) -> str:
    """The README block for one run: what was run, the SLO and its verdict, the systems
    beside their pairs, the comparisons, and the sweep if there was one."""
    t, m = doc["trace"], doc["machine"]
    systems = doc["systems"]
    lines = [f"Trace {t['name']}: {t['requests']} requests over {t['duration_s']:.0f} s, peak "
             f"{t['peak_rps']:.2f} req/s; {_where(m)}. SLO: {doc['slo']['text']}. "
             f"{_window(doc)}Verdict: {doc['slo_binding']['verdict']}.", ""]
    lines += _table(COLUMNS, [system_row(n, s, systems) for n, s in systems.items()])
    comps = [[f"{c['system']} / {c['baseline']}", _comparison_ratio(c),
              f"{_pct(c['system_attainment'])} / {_pct(c['baseline_attainment'])}"]
             for c in doc["comparisons"]]
    if comps:
        lines += ["", *_table(("comparison", "FT tokens/s ratio", "SLO attainment"), comps)]
    return "\n".join(lines + _sweep(doc) + _reference(doc)) + "\n"


def _system_text(name: str, s: dict, requests: int) -> str:
    met = round(s["slo_attainment"] * requests)
    ft = (f"{_ranged(s, 'ft_tokens_per_s', '.1f')} FT tokens/s (harvest "
          f"{_num(s['harvest']['ratio'], '.2f')}) at " if name != PILOT else "")
    return (f"{name} {ft}{_ranged(s, 'slo_attainment', '.1f', ' %', 100)} SLO attainment "
            f"({met} of {requests} requests)")


def summary(doc: dict) -> str:
    """The run's figures as one paragraph of prose: each system's fine-tuning and attainment,
    the pairs' ratios, the end-to-end latency against inference-only, and the verdict."""
    systems, n = doc["systems"], doc["trace"]["requests"]
    parts = [f"{_window(doc)}Measured: "
             + "; ".join(_system_text(k, s, n) for k, s in systems.items()) + "."]
    comps = [f"{c['system']} / {c['baseline']} {_comparison_ratio(c)}"
             for c in doc["comparisons"]]
    if comps:
        parts.append("Fine-tuning ratios: " + "; ".join(comps) + ".")
    e2e = [f"{k} {_num(m, '.2f', '×')} / {_num(p, '.2f', '×')}"
           for k in systems if k != PILOT for m, p in [e2e_ratios(k, systems)]]
    if e2e and PILOT in systems:
        parts.append("End-to-end latency ÷ inference-only's, mean / p95: " + "; ".join(e2e)
                     + ".")
    acc = doc.get("heldout_accuracy")
    if acc:
        parts.append(f"Held-out exact match of the adapter {acc['system']} trained: "
                     f"{_pct(acc['before'])} before, {_pct(acc['after'])} after.")
    verdict = doc["slo_binding"]["verdict"]
    parts.append(f"Verdict: {verdict[:1].upper()}{verdict[1:]}.")
    return " ".join(parts) + "\n"


RENDERERS = {"": render, "-summary": summary}


def render_file(path: Path, kind: str = "") -> str:
    return RENDERERS[kind](json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class Block:
    """A README results block: the file it names, what it holds, what that file renders to."""

    path: str
    body: str
    expected: str

    @property
    def matches(self) -> bool:
        return self.body == self.expected


def render_parity(base: Path, folders: str) -> str:
    """A hosts-parity block of the runs in ``folders`` (space-separated, relative to
    ``base``)."""
    return parity.render(parity.load_runs(base, folders.split()))


def blocks(readme: Path) -> list[Block]:
    """Every results and hosts-parity block of ``readme``; a named file that is missing is a
    FileNotFoundError."""
    text = readme.read_text()
    return ([Block(mt["path"], mt["body"], render_file(readme.parent / mt["path"], mt["kind"]))
             for mt in BLOCK.finditer(text)]
            + [Block(mt["path"], mt["body"], render_parity(readme.parent, mt["path"]))
               for mt in PARITY.finditer(text)])


def update(readme: Path) -> int:
    """Rewrite every results and hosts-parity block of ``readme`` from its files; the number of
    blocks."""
    text = readme.read_text()
    text, n = BLOCK.subn(lambda mt: mt["open"] + render_file(readme.parent / mt["path"],
                                                             mt["kind"]) + mt["close"], text)
    text, m = PARITY.subn(lambda mt: mt["open"] + render_parity(readme.parent, mt["path"])
                          + mt["close"], text)
    readme.write_text(text)
    return n + m


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deltaserve.bench.tables",
                                description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="?", help="a results.json to render")
    p.add_argument("--update", metavar="README", help="rewrite the README's results blocks")
    ns = p.parse_args(argv)
    if ns.update:
        print(f"rewrote {update(Path(ns.update))} results block(s) in {ns.update}")
    elif ns.results:
        sys.stdout.write(render_file(Path(ns.results)))
    else:
        p.error("give a results.json or --update README")
    return 0


if __name__ == "__main__":
    sys.exit(main())
