"""``deltaserve bench --host sim``: every system on the same simulated fleet, trace and data;
then the one-GPU ablations and (asked for) the sensitivity sweep. Writes ``results.json``,
``report.html`` (the bench's report) and ``paper.md`` (the comparison with the paper)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from deltaserve.bench.report import write_pages
from deltaserve.bench.sim.config import SimBenchConfig
from deltaserve.bench.sim.inputs import SimData, sim_trace
from deltaserve.bench.sim.paper import paper_markdown, paper_reference
from deltaserve.bench.sim.repeats import run_repeats, score_repeats
from deltaserve.bench.sim.results import results_doc
from deltaserve.bench.sim.run import log, prepare, run_ablation
from deltaserve.bench.sim.score import SimOutcome
from deltaserve.bench.sim.sensitivity import sensitivity_markdown, sweep
from deltaserve.bench.sim.systems import sim_systems
from deltaserve.bench.systems import PILOT
from deltaserve.hosts.sim import standalone


def warn_late_pilot(cfg: SimBenchConfig, outcomes: dict[str, SimOutcome], window_s: float
                    ) -> None:
    """As the real bench warns: a pilot still serving when the window closed left no idle
    capacity after it to charge (its steps after the window are not counted)."""
    pilot = outcomes.get(PILOT)
    drained = pilot.run.result.drained_s if pilot else None
    if drained is not None and drained > window_s:
        log(cfg, f"the pilot drained at {drained:.1f} simulated s, after the {window_s:.0f}-s "
                 f"window: its steps after it are not in the idle capacity (raise --drain-s)")


def run_sim_bench(cfg: SimBenchConfig, data: SimData | None = None) -> dict:
    """``data``: fine-tuning samples already tokenized (default: ``cfg.dataset``'s)."""
    t0 = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    setup = prepare(cfg, data=data)
    trace = sim_trace(cfg, setup.limits.max_model_len)
    log(cfg, f"{setup.hw.name}: {len(trace)} requests over {trace.duration_s:.0f} s, peak "
             f"{trace.peak_rate():.0f} req/s; {cfg.replicas} replicas; "
             f"{len(setup.data.samples)} samples")
    standalone_tps = standalone.tokens_per_s(setup.hw, setup.data.samples,
                                             cfg.backward.batch_tokens, seed=cfg.seed)
    reps = run_repeats(setup, sim_systems(cfg.systems), cfg.replicas, trace)
    setup, outcomes = reps.setup, reps.first  # setup.slo: the SLO every system ran at
    scored = score_repeats(reps, standalone_tps)
    warn_late_pilot(cfg, outcomes, cfg.window_s(trace.duration_s))
    ablation = run_ablation(setup, trace) if cfg.ablation else None
    results = results_doc(setup, trace, scored, ablation)
    results["paper"] = paper_reference(results)
    if cfg.sensitivity:
        results["sensitivity"] = sweep(setup, trace, cfg.replicas,
                                       echo=lambda m: log(cfg, f"sensitivity: {m}"))
    results["wall_s"] = time.perf_counter() - t0
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    write_pages(out, results, {n: outcomes[n].run for n in scored.scores}, setup.slo, trace)
    doc = paper_markdown(results)
    if cfg.sensitivity:
        doc += "\n" + sensitivity_markdown(results["sensitivity"])
    (out / "paper.md").write_text(doc)
    log(cfg, f"wrote {out}/results.json, report.html, paper.md in {results['wall_s']:.0f} s")
    return results
