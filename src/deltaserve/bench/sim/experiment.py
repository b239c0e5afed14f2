"""``deltaserve bench --host sim``: every system on the same simulated fleet, trace and data;
then the one-GPU ablations and (asked for) the sensitivity sweep. Writes ``results.json``,
``report.html`` (the bench's report) and ``paper.md`` (the comparison with the paper)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from deltaserve.bench import metrics as M
from deltaserve.bench.report import write_pages
from deltaserve.bench.score import order
from deltaserve.bench.sim.config import SimBenchConfig
from deltaserve.bench.sim.inputs import SimData, sim_trace
from deltaserve.bench.sim.paper import paper_markdown, paper_reference
from deltaserve.bench.sim.results import Scored, results_doc
from deltaserve.bench.sim.run import (
    SimSetup,
    base_of,
    log,
    prepare,
    run_ablation,
    run_systems,
    score_all,
)
from deltaserve.bench.sim.score import SimOutcome
from deltaserve.bench.sim.sensitivity import sensitivity_markdown, sweep
from deltaserve.bench.sim.systems import sim_systems
from deltaserve.bench.slo import derive_slo
from deltaserve.bench.systems import PILOT
from deltaserve.hosts.sim import standalone


def _scored(setup: SimSetup, outcomes: dict[str, SimOutcome], standalone_tps: float
            ) -> Scored:
    """Every system at the fixed SLO (the paper's, or the flags'): the pilot's p99s are
    recorded beside it, not used to set it."""
    pilot = outcomes.get(PILOT)
    ttft, tpot = (M.p99_latencies_ms(pilot.run.result.records) if pilot else (None, None))
    cfg = setup.cfg
    slo = derive_slo(ttft, tpot, 1.0, cfg.ttft_slo_ms, cfg.tpot_slo_ms)
    base = base_of(setup, outcomes, standalone_tps)
    names = order(tuple(o.run.spec for o in outcomes.values()))
    scores = score_all(setup, {n: outcomes[n] for n in names}, base)
    return Scored(slo, base, scores, standalone_tps)


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
    outcomes = run_systems(setup, sim_systems(cfg.systems), cfg.replicas, trace)
    scored = _scored(setup, outcomes, standalone_tps)
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
