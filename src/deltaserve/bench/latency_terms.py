"""Where the latency model's error comes from: refit its equations on a bench run's steps with
and without candidate terms, and compare the held-out error per step kind.

Reads the step logs a bench writes (``<out>/work/steps/*.jsonl``,
:mod:`deltaserve.bench.step_log`) and, per equation, fits the model's own regressors
(:func:`deltaserve.core.latency_terms.features`; relative weighting, non-negative least squares,
as :class:`~deltaserve.core.latency_model.LatencyModel` fits them) and each candidate that adds
one term. Every fit is scored by K-fold
cross-validation (each step predicted by a fit that never saw it): MAPE and bias (mean of
actual ÷ predicted less one) per step kind, over the steps of at least ``--min-ms``. The online
error of the run itself (each step's recorded prediction) is printed beside them, and the
model's coefficients fitted on every step (what a training token, an inference token and ζ
cost on this host). Per file, the
steps that ran at least ``--late`` times their online prediction are counted, with when they
ran (seconds from the file's first step) and whether a yield preceded them: a term fits a
trend, not a stall. And the time between steps that no step and no yield accounts for, before
each step with decodes in flight (a request's TPOT gap spans it, though no latency model
prices it). And a noise floor: each decode-only step against the median time of its
neighbours of the same shape (within ``--neighbours`` steps either side: the same decodes,
their KV within 2 %, the same yield state), the error of a predictor that saw those very
steps; where it is as large as the model's, no model of the shape can do much better.

    python -m deltaserve.bench.latency_terms results/X/work/steps/*.jsonl --out results/X/terms.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from itertools import pairwise
from pathlib import Path

import numpy as np

from deltaserve.bench.step_log import host_s, read_steps, shape_of
from deltaserve.core.latency_terms import TERMS, Equation, equation_of, features
from deltaserve.core.nnls import nnls
from deltaserve.core.shape import StepKind, StepShape, kind_of

Term = Callable[[StepShape], float]
# candidate terms, each added to the model's own regressors of Equation I (mixed steps)
CANDIDATES: dict[str, Term] = {
    "decodes": lambda s: float(s.num_decode),  # a decode row costs more than a prefill token
    "sequences": lambda s: float(len(s.prefill_lens) + s.num_decode),  # per-sequence overhead
    "ft_samples": lambda s: float(len(s.ft_lens)),  # per training row
    "decodes_x_ft": lambda s: float(s.num_decode * bool(s.ft_lens)),  # decodes beside LoRA rows
}


def _design(shapes: Sequence[StepShape], eq: Equation, term: Term | None) -> np.ndarray:
    rows = [features(s, eq) + ((term(s),) if term is not None else ()) for s in shapes]
    return np.array(rows, dtype=float)


def cross_validated(shapes: Sequence[StepShape], seconds: np.ndarray, eq: Equation,
                    term: Term | None, folds: int, seed: int) -> np.ndarray:
    """Each step's prediction by a relative-weighted NNLS fit on the other folds."""
    x = _design(shapes, eq, term)
    order = np.random.default_rng(seed).permutation(len(seconds))
    out = np.empty(len(seconds))
    for k in range(folds):
        test = order[k::folds]
        train = np.setdiff1d(order, test)
        w = 1.0 / seconds[train]
        coef = nnls(x[train] * w[:, None], seconds[train] * w)
        out[test] = x[test] @ coef
    return out


def by_kind(shapes: Sequence[StepShape], seconds: np.ndarray, predicted: np.ndarray) -> dict:
    """MAPE and bias per step kind (and over all)."""
    kinds = np.array([kind_of(s).value for s in shapes])
    out = {}
    for kind in [*sorted(set(kinds)), "all"]:
        m = np.ones(len(kinds), bool) if kind == "all" else kinds == kind
        p = np.maximum(predicted[m], 1e-9)
        out[kind] = {"steps": int(m.sum()),
                     "mape": float(np.mean(np.abs(p - seconds[m]) / seconds[m])),
                     "bias": float(np.mean(seconds[m] / p) - 1.0)}
    return out


def fitted_costs(shapes: Sequence[StepShape], seconds: np.ndarray, eq: Equation) -> dict:
    """The model's coefficients fitted on every step (relative weighting, NNLS), by name; for
    Equation I also the training tokens per second of its steps that carried nothing else."""
    x = _design(shapes, eq, None)
    w = 1.0 / seconds
    out: dict = {"coefficients": dict(zip(TERMS[eq], map(float, nnls(x * w[:, None],
                                                                       seconds * w)),
                                          strict=True))}
    if eq is Equation.MIXED:
        alone = [i for i, s in enumerate(shapes) if kind_of(s) is StepKind.FT_ONLY]
        if alone:
            tokens = sum(shapes[i].num_ft_tokens for i in alone)
            out["ft_only_tokens_per_s"] = tokens / float(seconds[alone].sum())
    return out


def analyse(rows: Sequence[dict], min_s: float, folds: int, seed: int) -> dict:
    """Per equation: the run's online error, the model's terms fitted on every step and
    cross-validated, and each candidate's (Equation I only: Equation II, decode-only steps,
    has no prefill or LoRA)."""
    rows = [r for r in rows if not r["aborted"] and r["seconds"] >= min_s]
    report: dict = {}
    for eq in Equation:
        mine = [r for r in rows if equation_of(shape_of(r)) is eq]
        if len(mine) < 2 * folds:
            continue
        shapes = [shape_of(r) for r in mine]
        seconds = np.array([r["seconds"] for r in mine])
        entry: dict = {"steps": len(mine)}
        online = [(s, r["predicted_s"], t) for s, r, t in zip(shapes, mine, seconds, strict=True)
                  if r["predicted_s"]]
        if online:
            entry["online"] = by_kind([s for s, _, _ in online], np.array([t for *_, t in online]),
                                      np.array([p for _, p, _ in online]))
        entry.update(fitted_costs(shapes, seconds, eq))
        entry["model_terms"] = by_kind(shapes, seconds,
                                       cross_validated(shapes, seconds, eq, None, folds, seed))
        if eq is Equation.MIXED:
            for name, term in CANDIDATES.items():
                entry[f"+{name}"] = by_kind(shapes, seconds, cross_validated(
                    shapes, seconds, eq, term, folds, seed))
        report[eq.value] = entry
    return report


def late_steps(rows: Sequence[dict], ratio: float, min_s: float) -> dict:
    """The steps of one run that took at least ``ratio`` times their online prediction."""
    timed = [r for r in rows if r["predicted_s"] and not r["aborted"] and r["seconds"] >= min_s]
    t0 = rows[0]["t_s"] if rows else 0.0
    late = [{"at_s": round(r["t_s"] - t0, 3), "seconds": r["seconds"],
             "ratio": round(r["seconds"] / r["predicted_s"], 2),
             "kind": kind_of(shape_of(r)).value, "after_yield": r["yielded_s"] > 0}
            for r in timed if r["seconds"] >= ratio * r["predicted_s"]]
    return {"steps": len(timed), "late": len(late), "ratio": ratio, "late_steps": late}


def step_gaps(rows: Sequence[dict]) -> dict:
    """Seconds between one step's end and the next one's start, less the yield before it, where
    the next step carries decodes (requests were in flight through the gap): median, p99, max
    and how many exceed 0.1 s; and, for those, how much of each gap the co-server's own hooks
    held (``hooks_s``; logs from before it was recorded count 0) and how much the host's own
    step held (its span less its forward and yield, the hooks in it included), where the host
    measured its span (``span_s``): the rest passed outside the host's step; and how long the
    process collected garbage since the step before's record (``gc_s``, where recorded)."""
    pairs = [(b["t_s"] - b["seconds"] - a["t_s"] - b["yielded_s"], b.get("hooks_s", 0.0),
              host_s(b), b.get("gc_s")) for a, b in pairwise(rows) if b["shape"]["num_decode"] > 0]
    if not pairs:
        return {"gaps": 0}
    gaps = np.array([g for g, *_ in pairs])
    long = [{"gap_ms": round(g * 1e3, 1), "hooks_ms": round(h * 1e3, 1)}
            | ({"host_ms": round(s * 1e3, 1), "outside_ms": round((g - s) * 1e3, 1)}
               if s is not None else {})
            | ({"gc_ms": round(c * 1e3, 1)} if c is not None else {})
            for g, h, s, c in pairs if g > 0.1]
    return {"gaps": len(gaps), "p50_ms": float(np.median(gaps) * 1e3),
            "p99_ms": float(np.quantile(gaps, 0.99) * 1e3), "max_ms": float(gaps.max() * 1e3),
            "over_100ms": int((gaps > 0.1).sum()),
            "hooks_p50_ms": float(np.median([h for _, h, *_ in pairs]) * 1e3),
            "long_gaps_ms": long}


def _same_shape(a: dict, b: dict) -> bool:
    s, t = a["shape"], b["shape"]
    return (t["num_decode"] == s["num_decode"] and not t["prefill_lens"] and not t["ft_lens"]
            and abs(t["kv_tokens"] - s["kv_tokens"]) <= 0.02 * s["kv_tokens"] + 8
            and bool(t.get("after_yield")) == bool(s.get("after_yield")))


def noise_floor(rows: Sequence[dict], min_s: float, neighbours: int) -> dict:
    """Decode-only steps of at least ``min_s`` with two or more same-shape steps within
    ``neighbours`` steps either side: the MAPE of those neighbours' median time, and of the
    step's online prediction, over the same steps."""
    rows = [r for r in rows if not r["aborted"]]
    model, floor = [], []
    for i, r in enumerate(rows):
        s = r["shape"]
        if s["prefill_lens"] or s["ft_lens"] or not s["num_decode"] or r["seconds"] < min_s \
                or not r["predicted_s"]:
            continue
        near = [q["seconds"] for q in rows[max(0, i - neighbours):i + neighbours + 1]
                if q is not r and _same_shape(r, q)]
        if len(near) >= 2:
            floor.append(abs(r["seconds"] - float(np.median(near))) / r["seconds"])
            model.append(abs(r["seconds"] - r["predicted_s"]) / r["seconds"])
    if not floor:
        return {"steps": 0}
    return {"steps": len(floor), "neighbour_mape": float(np.mean(floor)),
            "model_mape": float(np.mean(model))}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("steps", nargs="+", type=Path, help="step logs (JSON lines)")
    ap.add_argument("--min-ms", type=float, default=20.0, help="steps shorter are left out")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--late", type=float, default=1.6,
                    help="count each file's steps that took this many times their prediction")
    ap.add_argument("--neighbours", type=int, default=3,
                    help="the noise floor's same-shape steps, this many either side")
    ap.add_argument("--out", type=Path, help="write the report as JSON here")
    args = ap.parse_args(argv)
    per_file = {p: read_steps(p) for p in args.steps}
    rows = [r for file_rows in per_file.values() for r in file_rows]
    report = {"files": [str(p) for p in args.steps], "min_ms": args.min_ms,
              "folds": args.folds, "equations": analyse(rows, args.min_ms / 1e3, args.folds,
                                                        args.seed),
              "late": {p.name: late_steps(r, args.late, args.min_ms / 1e3)
                       for p, r in per_file.items()},
              "gaps": {p.name: step_gaps(r) for p, r in per_file.items()},
              "floor": {p.name: noise_floor(r, args.min_ms / 1e3, args.neighbours)
                        for p, r in per_file.items()}}
    for eq, entry in report["equations"].items():
        print(f"equation {eq}: {entry['steps']} steps")
        print("  fitted on every step: " + ", ".join(
            f"{k} {v:.3g}" for k, v in entry["coefficients"].items())
            + (f"; training-only steps {entry['ft_only_tokens_per_s']:.0f} tokens/s"
               if "ft_only_tokens_per_s" in entry else ""))
        for fit, kinds in entry.items():
            if fit in ("steps", "coefficients", "ft_only_tokens_per_s"):
                continue
            print(f"  {fit:>14}: " + "; ".join(f"{k} {v['mape']:.1%} (bias {v['bias']:+.1%}, "
                                               f"{v['steps']})" for k, v in kinds.items()))
    for name, late in report["late"].items():
        print(f"{name}: {late['late']} of {late['steps']} steps took >= {args.late:g}x their "
              f"prediction" + "".join(f"; {x['kind']} at {x['at_s']:.1f} s {x['ratio']:.1f}x"
                                      for x in late["late_steps"][:12]))
    for name, g in report["gaps"].items():
        if g["gaps"]:
            print(f"{name}: between steps with decodes in flight, unaccounted: median "
                  f"{g['p50_ms']:.1f} ms, p99 {g['p99_ms']:.1f} ms, max {g['max_ms']:.0f} ms, "
                  f"{g['over_100ms']} over 100 ms (the co-server's hooks: median "
                  f"{g['hooks_p50_ms']:.1f} ms; in those: "
                  + ", ".join(f"{x['hooks_ms']:.0f} of {x['gap_ms']:.0f}"
                              + (f" (host {x['host_ms']:.0f}, outside {x['outside_ms']:.0f})"
                                 if "host_ms" in x else "")
                              + (f" [gc {x['gc_ms']:.0f}]" if "gc_ms" in x else "")
                              for x in g["long_gaps_ms"]) + ")")
    for name, f in report["floor"].items():
        if f["steps"]:
            print(f"{name}: {f['steps']} decode steps beside same-shape ones: the neighbours' "
                  f"median {f['neighbour_mape']:.1%} off, the online model {f['model_mape']:.1%}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
