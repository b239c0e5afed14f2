"""``deltaserve bench --host sim``: every system on the same simulated fleet, trace and data;
then the one-GPU ablations and (asked for) the sensitivity sweep. Writes ``results.json``,
``report.html`` (the bench's report) and ``paper.md`` (the comparison with the paper)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from deltaserve.bench.report import write_report
from deltaserve.bench.sim.config import SimBenchConfig
from deltaserve.bench.sim.inputs import SimData, sim_trace
from deltaserve.bench.sim.paper import paper_markdown
from deltaserve.bench.sim.results import results_doc
from deltaserve.bench.sim.run import log, prepare, run_ablation, run_systems, score_all
from deltaserve.bench.sim.sensitivity import sensitivity_markdown, sweep
from deltaserve.bench.sim.systems import sim_systems
from deltaserve.hosts.sim import standalone


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
    systems = score_all(setup, outcomes, standalone_tps)
    ablation = run_ablation(setup, trace) if cfg.ablation else None
    results = results_doc(setup, trace, systems, standalone_tps, ablation)
    if cfg.sensitivity:
        results["sensitivity"] = sweep(setup, trace, cfg.replicas,
                                       echo=lambda m: log(cfg, f"sensitivity: {m}"))
    results["wall_s"] = time.perf_counter() - t0
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    write_report(out, results, {n: o.run for n, o in outcomes.items()}, trace, setup.slo)
    doc = paper_markdown(results)
    if cfg.sensitivity:
        doc += "\n" + sensitivity_markdown(results["sensitivity"])
    (out / "paper.md").write_text(doc)
    log(cfg, f"wrote {out}/results.json, report.html, paper.md in {results['wall_s']:.0f} s")
    return results
