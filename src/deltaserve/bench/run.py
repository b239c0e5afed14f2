"""``deltaserve bench``: every system on the same trace, model and data, in one run.

Order of work: calibrate the host (its latency model seeds every system), fit the trace to the
host's capacity, run the pilot (inference-only on the whole machine) and derive the SLO from
its p99s, measure standalone training throughput, replay the trace per system (an SLO-aware
system once per SLO scale of a sweep), score the trained adapter on held-out examples, and
write ``results.json``, ``report.html`` and its plots to ``--out``. Everything bulky
(checkpoints, the generated data, calibrations) goes to ``<out>/work``, which ignores itself
in git, so a results folder can be committed as it is.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from deltaserve.bench import metrics as M
from deltaserve.bench.accuracy import heldout_accuracy
from deltaserve.bench.config import BenchConfig
from deltaserve.bench.execute import RunInputs, hardware_share, run_system
from deltaserve.bench.outcome import SystemRun
from deltaserve.bench.prepare import build_trace, calibrate, host_limits, load_data, log
from deltaserve.bench.report import write_report
from deltaserve.bench.results import BenchResults, HeldoutAccuracy, Machine, SweepPoint
from deltaserve.bench.score import HarvestBase, binding, comparisons, harvest_base, order, score_run
from deltaserve.bench.slo import SLOChoice, derive_slo
from deltaserve.bench.split_pool import standalone_tokens_per_s
from deltaserve.bench.systems import PILOT, SystemSpec, parse_systems
from deltaserve.core.latency_model import LatencyModel
from deltaserve.model.loading import load_tokenizer, resolve_model
from deltaserve.model.random_models import is_random


@dataclass
class Replays:
    """Every replay of a run: the pilot, the SLO-blind systems (run once), and the SLO-aware
    ones per scale; ``slos`` holds each scale's SLO."""

    slos: dict[float, SLOChoice]
    once: dict[str, SystemRun]
    by_scale: dict[float, dict[str, SystemRun]]

    def at(self, scale: float, name: str) -> SystemRun:
        return self.by_scale.get(scale, {}).get(name) or self.once[name]


def _announce(cfg: BenchConfig, run: SystemRun, slo: SLOChoice) -> None:
    commits, r = run.window_commits(), run.result
    m = M.compute(r.records, slo.config, r.wall_s, sum(c.num_tokens for c in commits),
                  len(commits), None)
    log(cfg, f"{run.spec.name}: {m.ft_tokens_per_s:.1f} FT tokens/s, SLO attainment "
             f"{m.slo_attainment:.1%}, TTFT p99 {m.ttft_p99_ms or 0:.0f} ms, TPOT p99 "
             f"{m.tpot_p99_ms or 0:.0f} ms")


def _slos(cfg: BenchConfig, pilot: SystemRun) -> dict[float, SLOChoice]:
    ttft, tpot = M.p99_latencies_ms(pilot.result.records)
    slos = {s: derive_slo(ttft, tpot, s, cfg.ttft_slo_ms, cfg.tpot_slo_ms)
            for s in cfg.slo_scales}
    log(cfg, f"pilot p99: TTFT {ttft or 0:.0f} ms, max TPOT {tpot or 0:.0f} ms; SLO "
             f"{slos[cfg.slo_scale].describe()}")
    return slos


def replay_all(inputs: RunInputs, specs: tuple[SystemSpec, ...]) -> Replays:
    """The pilot first (the SLO comes from it), then every system at the main scale, then the
    SLO-aware systems at the sweep's other scales."""
    cfg = inputs.cfg
    pilot = run_system(inputs, specs[0], None, None)
    slos = _slos(cfg, pilot)
    reps = Replays(slos, {PILOT: pilot}, {s: {} for s in slos})
    for scale in sorted(slos, key=lambda s: s != cfg.slo_scale):
        for spec in specs[1:]:
            if spec.slo_aware:
                run = reps.by_scale[scale][spec.name] = run_system(
                    inputs, spec, slos[scale].config, scale)
            elif scale == cfg.slo_scale:
                run = reps.once[spec.name] = run_system(inputs, spec, slos[scale].config, None)
            else:
                continue
            _announce(cfg, run, slos[scale])
    return reps


def _point(reps: Replays, scale: float, names: list[str], base: HarvestBase) -> SweepPoint:
    slo = reps.slos[scale]
    return SweepPoint(slo, {n: score_run(reps.at(scale, n), slo.config, base) for n in names})


def _accuracy(cfg: BenchConfig, data_heldout, reps: Replays, threads: int
              ) -> HeldoutAccuracy | None:
    run = reps.by_scale[cfg.slo_scale].get("deltaserve")
    if not data_heldout or run is None or is_random(cfg.engine.model):
        return None  # a random model's answers are noise: nothing to score
    return heldout_accuracy(cfg, data_heldout, run.adapter_dir, threads, "deltaserve")


def out_dir(cfg: BenchConfig, today: datetime.date | None = None) -> Path:
    """``--out`` with ``{date}``, ``{host}`` and ``{trace}`` filled in: the committed results'
    layout is ``results/{date}-{host}-{trace}``."""
    trace = Path(cfg.trace).stem if Path(cfg.trace).suffix else cfg.trace
    return Path(cfg.out.format(date=(today or datetime.date.today()).isoformat(),
                               host=cfg.host, trace=trace))


def _workdir(out: Path) -> Path:
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    (work / ".gitignore").write_text("# bulky run state (checkpoints, data, calibrations)\n*\n")
    return work


def run_bench(cfg: BenchConfig) -> dict:
    t_start, load_start = time.monotonic(), os.getloadavg()[0]
    out = out_dir(cfg)
    work = _workdir(out)
    threads = torch.get_num_threads()
    specs = parse_systems(cfg.systems)
    model_path = resolve_model(cfg.engine.model)
    data = load_data(cfg, work, load_tokenizer(model_path))
    lm_paths = {n: calibrate(cfg, work, n)
                for n in sorted({hardware_share(cfg, s, threads).host for s in specs})}
    lm = LatencyModel.load(lm_paths[threads])
    fitted = build_trace(cfg, lm, host_limits(cfg, model_path))
    inputs = RunInputs(cfg, fitted.trace, data, lm_paths, work, threads)
    standalone = standalone_tokens_per_s(
        str(model_path), data.samples, cfg.lora, cfg.optimizer, cfg.backward.batch_tokens,
        threads, cfg.standalone_seconds, dtype=cfg.engine.dtype, seed=cfg.seed,
        device=cfg.engine.device)
    log(cfg, f"standalone training on {threads} threads: {standalone:.1f} tokens/s")
    reps = replay_all(inputs, specs)
    base = harvest_base(reps.once[PILOT], standalone)
    names = order(specs)
    main = _point(reps, cfg.slo_scale, names, base)
    sweep = [_point(reps, s, names, base) for s in sorted(reps.slos)] if cfg.slo_sweep else []
    results = BenchResults(
        fitted, main.slo, main, binding(main.scores), comparisons(main.scores), sweep, base,
        Machine(threads, os.cpu_count(), torch.cuda.is_available(), cfg.host, cfg.engine.model,
                (load_start, os.getloadavg()[0])),
        lm.quality(), data.report, data.path, cfg, _accuracy(cfg, data.heldout, reps, threads),
        time.monotonic() - t_start)
    doc = results.write(out / "results.json")
    write_report(out, results, reps.by_scale[cfg.slo_scale] | reps.once)
    log(cfg, f"{results.binding.verdict}")
    log(cfg, f"wrote {out / 'results.json'} and {out / 'report.html'} in {results.wall_s:.0f} s")
    return doc
