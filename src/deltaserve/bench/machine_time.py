"""Where a bench run's machine time went, per system and repeat, and what that bounds.

On a host whose engine steps and backward share the same cores and never overlap (the
``exclusive`` grant policy, every CPU host), a repeat's window splits into:

* ``inference_step_s``: the forward of steps that carried only inference rows;
* ``ft_step_s``: the forward of steps that carried training rows (with any inference rows
  beside them);
* ``host_s``: the engine's own work around its steps (scheduling, sampling, output
  processing: each step's span less its forward and the yield before it), which neither the
  forward nor the backward uses;
* ``backward_s``: the backward's layers (its log's wall time less the time it waited on the
  grant, pro-rated to the window);
* ``unused_s``: the rest, which no system used.

From the same logs: the training tokens a forward-only step of training rows ran per second,
and the tokens the backward ran per second of its own compute. With the fitted cost of a
training token inside a mixed step (Equation I's ``gamma``,
:func:`deltaserve.bench.latency_terms.fitted_costs`), that bounds what any admission policy
could train in the same window beside the same inference: every second this repeat spent on
training (its training-carrying steps, inference rows in them included, and its backward) and
every unused second, spent at the cheapest a training token costs (forwarded in a mixed step,
then its backward),

    ceiling = (ft_step_s + backward_s + unused_s) / ((gamma + 1/backward_rate) x backward_tokens)

times this repeat's tokens. It is an upper bound: it leaves out what training rows add to the
inference rows beside them (Equation I's ``zeta``) and what more steps add to ``host_s``.

Reads a committed run folder (``steps/NAME.jsonl.gz`` and ``train/NAME.jsonl.gz``) or a run's
work folder (``work/steps/NAME.jsonl``, ``work/checkpoints/NAME/train_log.jsonl``); ``NAME`` is
``<system>[-<SLO scale>]-<repeat>``.

    python -m deltaserve.bench.machine_time results/X --out results/X/machine_time.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from deltaserve.bench.latency_terms import fitted_costs
from deltaserve.bench.step_log import host_s, read_json_lines, read_steps, shape_of
from deltaserve.core.latency_terms import Equation, equation_of
from deltaserve.core.shape import StepKind, kind_of


@dataclass(frozen=True)
class RepeatTime:
    """One repeat's window, split (seconds), and its training rates."""

    window_s: float
    inference_step_s: float
    ft_step_s: float
    host_s: float
    backward_s: float
    unused_s: float
    ft_tokens_forwarded: int
    backward_tokens: float  # pro-rated to the window, like backward_s
    ft_only_tokens_per_s: float | None  # training-only steps' forward
    backward_tokens_per_s: float | None  # per second of the backward's own compute


def read_train_log(path: Path) -> list[dict]:
    """The optimizer steps of a trainer's log (``train_log.jsonl``, gzip where ``.gz``)."""
    return [r for r in read_json_lines(path) if r.get("event") == "OptimizerStep"]


def _overlap(start_s: float, end_s: float, lo_s: float, hi_s: float) -> float:
    """The share of [start_s, end_s] inside [lo_s, hi_s] (1 for an empty interval inside)."""
    if end_s <= start_s:
        return float(lo_s <= start_s <= hi_s)
    return max(0.0, min(end_s, hi_s) - max(start_s, lo_s)) / (end_s - start_s)


def repeat_time(steps: Sequence[dict], train: Sequence[dict], window_s: float) -> RepeatTime:
    """Split the window that starts at the first step's start (a step row's ``t_s`` is when
    its forward ended, on the clock the trainer's ``at_s`` uses)."""
    t0 = steps[0]["t_s"] - steps[0]["seconds"]
    t1 = t0 + window_s
    inside = [r for r in steps if r["t_s"] <= t1]
    inf_s = sum(r["seconds"] for r in inside if not r["ft_tokens"])
    ft_s = sum(r["seconds"] for r in inside if r["ft_tokens"])
    own_s = sum(max(0.0, host_s(r) or 0.0) for r in inside)
    bwd_s = bwd_tokens = 0.0
    for job in train:
        share = _overlap(job["at_s"] - job["wall_s"], job["at_s"], t0, t1)
        bwd_s += share * (job["wall_s"] - job["paused_s"])
        bwd_tokens += share * job["num_tokens"]
    alone = [r for r in inside
             if not r["aborted"] and kind_of(shape_of(r)) is StepKind.FT_ONLY]
    alone_s = sum(r["seconds"] for r in alone)
    return RepeatTime(
        window_s=window_s, inference_step_s=inf_s, ft_step_s=ft_s, host_s=own_s,
        backward_s=bwd_s, unused_s=window_s - inf_s - ft_s - own_s - bwd_s,
        ft_tokens_forwarded=sum(r["ft_tokens"] for r in inside), backward_tokens=bwd_tokens,
        ft_only_tokens_per_s=sum(r["ft_tokens"] for r in alone) / alone_s if alone_s else None,
        backward_tokens_per_s=bwd_tokens / bwd_s if bwd_s > 0 else None)


def ceiling(t: RepeatTime, gamma_s: float) -> float | None:
    """How many times this repeat's training tokens a policy could reach in the same window,
    spending its training time and its unused time at ``gamma_s`` a token forward (a mixed
    step) and the backward's measured rate (module docstring); ``None`` without a backward."""
    if not t.backward_tokens_per_s or t.backward_tokens <= 0:
        return None
    usable_s = t.ft_step_s + t.backward_s + max(0.0, t.unused_s)
    return usable_s / ((gamma_s + 1.0 / t.backward_tokens_per_s) * t.backward_tokens)


def gamma_of(steps: Sequence[dict], min_s: float = 0.02) -> float:
    """A training token's cost in a mixed step: Equation I fitted on every step given."""
    rows = [r for r in steps if not r["aborted"] and r["seconds"] >= min_s
            and equation_of(shape_of(r)) is Equation.MIXED]
    costs = fitted_costs([shape_of(r) for r in rows], np.array([r["seconds"] for r in rows]),
                         Equation.MIXED)
    return float(costs["coefficients"]["gamma"])


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise(repeats: dict[str, list[RepeatTime]], gamma_s: float) -> dict:
    """Per system: each repeat's split and the medians of its fields and of its ceiling."""
    out: dict = {}
    for system, times in sorted(repeats.items()):
        fields = asdict(times[0]).keys()
        ceilings = [ceiling(t, gamma_s) for t in times]
        out[system] = {"repeats": [asdict(t) | {"ceiling": c} for t, c in zip(times, ceilings,
                                                                              strict=True)],
                       "median": {f: _median([getattr(t, f) for t in times]) for f in fields},
                       "ceiling": _median(ceilings)}
    return out


def system_of(name: str) -> str:
    """The system of a repeat's log name, ``<system>[-<SLO scale>]-<repeat>`` (the bench's
    label ``deltaserve @2 #3``): ``deltaserve-pipeline-1.5-3`` -> ``deltaserve-pipeline``."""
    m = re.fullmatch(r"(.+?)(?:-\d+(?:\.\d+)?)?-\d+", name)
    return m[1] if m else name


def find_logs(run: Path) -> dict[str, tuple[Path, Path]]:
    """Each training repeat's (step log, trainer log), committed layout first."""
    pairs: dict[str, tuple[Path, Path]] = {}
    for train in sorted((run / "train").glob("*.jsonl.gz")):
        name = train.name.removesuffix(".jsonl.gz")
        pairs[name] = (run / "steps" / f"{name}.jsonl.gz", train)
    for train in sorted((run / "work" / "checkpoints").glob("*/train_log.jsonl")):
        name = train.parent.name
        pairs.setdefault(name, (run / "work" / "steps" / f"{name}.jsonl", train))
    return {k: v for k, v in pairs.items() if v[0].exists()}


def analyse_run(run: Path, window_s: float) -> dict:
    logs = find_logs(run)
    if not logs:
        raise SystemExit(f"run: no step and trainer logs of a training system under {run}")
    steps = {name: read_steps(s) for name, (s, _) in logs.items()}
    gamma_s = gamma_of([r for rows in steps.values() for r in rows])
    repeats: dict[str, list[RepeatTime]] = {}
    for name, (_, train) in logs.items():
        t = repeat_time(steps[name], read_train_log(train), window_s)
        repeats.setdefault(system_of(name), []).append(t)
    return {"run": str(run), "window_s": window_s, "gamma_s": gamma_s,
            "systems": summarise(repeats, gamma_s)}


def _print(report: dict) -> None:
    print(f"{report['run']}: {report['window_s']:g}-s window; a training token in a mixed "
          f"step {report['gamma_s'] * 1e3:.2f} ms (Equation I fitted on every step)")
    for system, entry in report["systems"].items():
        m = entry["median"]
        rates = (f"; training-only forward {m['ft_only_tokens_per_s']:.0f} tokens/s"
                 if m["ft_only_tokens_per_s"] else "") + (
            f", backward {m['backward_tokens_per_s']:.0f} tokens/s"
            if m["backward_tokens_per_s"] else "")
        bound = f"; ceiling {entry['ceiling']:.2f}x" if entry["ceiling"] else ""
        print(f"  {system}: inference steps {m['inference_step_s']:.1f} s, training steps "
              f"{m['ft_step_s']:.1f} s, host {m['host_s']:.1f} s, backward "
              f"{m['backward_s']:.1f} s, unused {m['unused_s']:.1f} s (medians of "
              f"{len(entry['repeats'])}){rates}{bound}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a run folder (committed or with its work/)")
    ap.add_argument("--window-s", type=float, default=None,
                    help="the window (default: results.json's window_s)")
    ap.add_argument("--out", type=Path, help="write the report as JSON here")
    args = ap.parse_args(argv)
    window_s = args.window_s
    if window_s is None:
        results = args.run / "results.json"
        if not results.exists():
            raise SystemExit(f"--window-s: none given and no {results} to read it from")
        window_s = float(json.loads(results.read_text())["window_s"])
    report = analyse_run(args.run, window_s)
    _print(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
