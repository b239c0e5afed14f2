"""``deltaserve bench``: every system on the same trace, model and data, in one run.

Order of work: calibrate the host (its latency model seeds every system), fit the trace to the
host's capacity, run the pilot (inference-only on the whole machine) and derive the SLO from
its p99s, measure standalone training throughput, replay the trace per system (an SLO-aware
system once per SLO scale of a sweep; every system ``--repeats`` times, interleaved; the scored
inference-only row is a replay of its own, not the pilot), score every system's fine-tuning in
one window (the trace's duration plus ``--drain-s``), score the trained adapter on held-out
examples, and write ``results.json`` (with the run's provenance), ``COMMAND``, ``report.html``
and its plots to ``--out``. Everything bulky
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
from deltaserve.bench import provenance
from deltaserve.bench.accuracy import heldout_accuracy
from deltaserve.bench.config import BenchConfig
from deltaserve.bench.execute import RunInputs, hardware_share, run_system
from deltaserve.bench.fleet_score import FleetScore, announce, fleet_score
from deltaserve.bench.outcome import SystemRun
from deltaserve.bench.prepare import build_trace, calibrate, host_limits, load_data, log
from deltaserve.bench.repeats import summarize
from deltaserve.bench.replicas import check_replicas, run_replicated, threads_per_replica
from deltaserve.bench.report import write_report
from deltaserve.bench.results import BenchResults, HeldoutAccuracy, Machine, SweepPoint
from deltaserve.bench.score import HarvestBase, binding, comparisons, harvest_base, order, score_run
from deltaserve.bench.slo import SLOChoice, derive_slo, median_p99s_ms
from deltaserve.bench.split_pool import standalone_tokens_per_s
from deltaserve.bench.systems import SystemSpec, parse_systems
from deltaserve.core.latency_model import LatencyModel
from deltaserve.model.loading import load_tokenizer, resolve_model
from deltaserve.model.random_models import is_random


@dataclass
class Replays:
    """Every replay of a run: the pilot (it sets the SLO and the idle capacity; it is not a
    scored row), each SLO-blind system's repeats (inference-only's among them: a second,
    independent replay), and each SLO-aware one's per scale; ``slos`` holds each scale's SLO."""

    pilot: SystemRun
    slos: dict[float, SLOChoice]
    once: dict[str, list[SystemRun]]
    by_scale: dict[float, dict[str, list[SystemRun]]]

    def at(self, scale: float, name: str) -> list[SystemRun]:
        return self.by_scale.get(scale, {}).get(name) or self.once[name]

    def first(self, scale: float) -> dict[str, SystemRun]:
        """The first repeat of every system at ``scale`` (the report's plots draw these)."""
        names = {*self.once, *self.by_scale.get(scale, {})}
        return {n: self.at(scale, n)[0] for n in names}


def _announce(cfg: BenchConfig, run: SystemRun, slo: SLOChoice, window: float) -> None:
    commits, r = run.window_commits(window), run.result
    m = M.compute(r.records, slo.config, window, sum(c.num_tokens for c in commits),
                  len(commits), None)
    log(cfg, f"{run.spec.name}: {m.ft_tokens_per_s:.1f} FT tokens/s in the {window:.0f} s "
             f"window, SLO attainment {m.slo_attainment:.1%}, TTFT p99 {m.ttft_p99_ms or 0:.0f} "
             f"ms, TPOT p99 {m.tpot_p99_ms or 0:.0f} ms, drained at {r.drained_s or 0:.0f} s")
    if run.latency_kinds:
        log(cfg, f"{run.spec.name}: latency model online, by step kind: " + "; ".join(
            f"{e.kind} {e.mode} {e.mape:.1%} (bias {e.bias:+.1%}, {e.steps} steps)"
            for e in run.latency_kinds))
    if run.latency_yields:
        log(cfg, f"{run.spec.name}: latency model, by step kind and yield: " + "; ".join(
            f"{e.kind} {e.mode} {e.mape:.1%} (bias {e.bias:+.1%}, {e.steps} steps)"
            for e in run.latency_yields))


def _slos(cfg: BenchConfig, pilots: list[SystemRun]) -> dict[float, SLOChoice]:
    """Each scale's SLO, from the median over the pilots of each side's p99."""
    p99s = [M.p99_latencies_ms(p.result.records) for p in pilots]
    if len(pilots) > 1:
        log(cfg, "pilots' p99s: " + "; ".join(
            f"TTFT {t or 0:.0f} ms, max TPOT {g or 0:.0f} ms" for t, g in p99s))
    ttft, tpot = median_p99s_ms(p99s)
    slos = {s: derive_slo(ttft, tpot, s, cfg.ttft_slo_ms, cfg.tpot_slo_ms, len(pilots))
            for s in cfg.slo_scales}
    which = "pilot" if len(pilots) == 1 else f"median of {len(pilots)} pilots'"
    log(cfg, f"{which} p99: TTFT {ttft or 0:.0f} ms, max TPOT {tpot or 0:.0f} ms; SLO "
             f"{slos[cfg.slo_scale].describe()}")
    return slos


def replay_all(inputs: RunInputs, specs: tuple[SystemSpec, ...]) -> Replays:
    """The pilot first (``pilot_repeats`` times: the SLO comes from their median p99s, the
    idle capacity from the first), then ``repeats`` rounds; each round runs every system once
    at the main scale, inference-only included (its scored row is this second replay, not the
    pilot), then the SLO-aware systems at the sweep's other scales. Interleaving the rounds
    spreads slow drifts of the machine over every system alike."""
    cfg = inputs.cfg
    # --replicas N > 1: every system, the pilot included, as N replicas of the host
    run_system_ = run_system if cfg.replicas == 1 else run_replicated
    pilots = [run_system_(inputs, specs[0], None, None,
                          label="pilot" if k == 0 else f"pilot-{k + 1}")
              for k in range(cfg.pilot_repeats)]
    slos = _slos(cfg, pilots)
    reps = Replays(pilots[0], slos, {}, {s: {} for s in slos})
    window = cfg.window_s(inputs.trace.duration_s)
    for k in range(cfg.repeats):
        tag = f" #{k + 1}" if cfg.repeats > 1 else ""
        for scale in sorted(slos, key=lambda s: s != cfg.slo_scale):
            for spec in specs:
                if spec.slo_aware:
                    run = run_system_(inputs, spec, slos[scale].config, scale, tag=tag)
                    reps.by_scale[scale].setdefault(spec.name, []).append(run)
                elif scale == cfg.slo_scale:
                    run = run_system_(inputs, spec, slos[scale].config, None, tag=tag)
                    reps.once.setdefault(spec.name, []).append(run)
                else:
                    continue
                _announce(cfg, run, slos[scale], window)
    return reps


def _point(reps: Replays, scale: float, names: list[str], base: HarvestBase) -> SweepPoint:
    slo = reps.slos[scale]
    return SweepPoint(slo, {n: summarize([score_run(r, slo.config, base)
                                          for r in reps.at(scale, n)]) for n in names})


def _accuracy(cfg: BenchConfig, data_heldout, reps: Replays, threads: int
              ) -> HeldoutAccuracy | None:
    runs = reps.by_scale[cfg.slo_scale].get("deltaserve")
    if not data_heldout or not runs or is_random(cfg.engine.model):
        return None  # a random model's answers are noise: nothing to score
    return heldout_accuracy(cfg, data_heldout, runs[0].adapter_dir, threads, "deltaserve")


def _fleets(cfg: BenchConfig, reps: Replays, names: list[str], window_s: float
            ) -> dict[str, FleetScore] | None:
    """With replicas: each system's replicas at the main scale (its first repeat)."""
    if cfg.replicas == 1:
        return None
    slo = reps.slos[cfg.slo_scale].config
    fleets = {n: fleet_score(reps.at(cfg.slo_scale, n)[0], slo, window_s) for n in names}
    for n, fleet in fleets.items():
        announce(cfg, n, fleet)
    return fleets


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
    check_replicas(cfg, specs, threads)
    model_path = resolve_model(cfg.engine.model)
    data = load_data(cfg, work, load_tokenizer(model_path))
    if cfg.replicas == 1:
        host_counts = {hardware_share(cfg, s, threads).host for s in specs}
        fit_threads = threads
    else:  # every replica of every system runs on its share of the threads
        fit_threads = threads_per_replica(cfg, threads)
        host_counts = {fit_threads}
    lm_paths = {n: calibrate(cfg, work, n) for n in sorted(host_counts)}
    lm = LatencyModel.load(lm_paths[fit_threads])
    fitted = build_trace(cfg, lm, host_limits(cfg, model_path), replicas=cfg.replicas)
    inputs = RunInputs(cfg, fitted.trace, data, lm_paths, work, threads)
    standalone = standalone_tokens_per_s(
        str(model_path), data.samples, cfg.lora, cfg.optimizer, cfg.backward.batch_tokens,
        threads, cfg.standalone_seconds, dtype=cfg.engine.dtype, seed=cfg.seed,
        device=cfg.engine.device)
    log(cfg, f"standalone training on {threads} threads: {standalone:.1f} tokens/s")
    reps = replay_all(inputs, specs)
    base = harvest_base(reps.pilot, standalone, cfg.window_s(fitted.trace.duration_s))
    drained = reps.pilot.result.drained_s
    if drained is not None and base.window_s is not None and drained > base.window_s:
        log(cfg, f"the pilot drained at {drained:.1f} s, after the {base.window_s:.0f}-s window: "
                 f"its steps after it are not in the idle capacity (raise --drain-s)")
    names = order(specs)
    main = _point(reps, cfg.slo_scale, names, base)
    sweep = [_point(reps, s, names, base) for s in sorted(reps.slos)] if cfg.slo_sweep else []
    results = BenchResults(
        fitted, main.slo, main, binding(main.scores), comparisons(main.scores), sweep, base,
        Machine(threads, os.cpu_count(), torch.cuda.is_available(), cfg.host, cfg.engine.model,
                (load_start, os.getloadavg()[0])),
        lm.quality(), data.report, data.path, cfg, _accuracy(cfg, data.heldout, reps, threads),
        time.monotonic() - t_start, provenance.collect(),
        _fleets(cfg, reps, names, cfg.window_s(fitted.trace.duration_s)))
    doc = results.write(out / "results.json")
    write_report(out, results, reps.first(cfg.slo_scale))
    log(cfg, f"{results.binding.verdict}")
    log(cfg, f"wrote {out / 'results.json'} and {out / 'report.html'} in {results.wall_s:.0f} s")
    return doc
