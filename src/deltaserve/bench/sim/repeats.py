"""A simulated experiment's repeats and its SLO, run as the real bench runs them
(``--repeats N``, ``--slo-scale S``): the pilot (inference-only) N times, each repeat on its own
step-noise seed; the SLO ``S`` × the median of the pilots' p99s (or the flags' fixed SLO, the
pilots' p99s recorded beside it); then every other system N times at that SLO. The pilots are
inference-only's scored repeats: a simulation given the same seed replays the same steps.

A system's score is the bench's :func:`~deltaserve.bench.repeats.summarize` of its repeats
(medians, each repeat's metrics kept for the ranges), against one harvest base: the first
pilot's idle capacity, as on the real bench. The simulation's own figures (tail latencies, GPU
busy time, the fleet's speed) are those of its median repeat by FT tokens."""

from __future__ import annotations

from dataclasses import dataclass, replace

from deltaserve.bench import metrics as M
from deltaserve.bench.repeats import summarize
from deltaserve.bench.score import order
from deltaserve.bench.sim.config import SimBenchConfig
from deltaserve.bench.sim.results import Scored
from deltaserve.bench.sim.run import SimSetup, base_of, log, run_systems
from deltaserve.bench.sim.score import SimOutcome, SimScore, score
from deltaserve.bench.slo import SLOChoice, derive_slo, median_p99s_ms
from deltaserve.bench.systems import PILOT, SystemSpec
from deltaserve.workloads.trace import Trace


@dataclass(frozen=True)
class Repeats:
    """Every system's repeats, in run order, and the SLO they ran at (``setup.slo``)."""

    setup: SimSetup
    slo: SLOChoice
    outcomes: dict[str, list[SimOutcome]]

    @property
    def first(self) -> dict[str, SimOutcome]:
        """Each system's first repeat (the report's pages show these)."""
        return {name: runs[0] for name, runs in self.outcomes.items()}


def pilot_slo(cfg: SimBenchConfig, pilots: list[SimOutcome]) -> SLOChoice:
    """``cfg.slo_scale`` × the median of ``pilots``' p99s, or the flags' SLO with those
    medians beside it (no pilot: the flags' SLO alone)."""
    p99s = [M.p99_latencies_ms(p.run.result.records) for p in pilots]
    ttft, tpot = median_p99s_ms(p99s)
    pilots_n = max(1, len(pilots))
    if cfg.slo_scale is None:
        return derive_slo(ttft, tpot, 1.0, cfg.ttft_slo_ms, cfg.tpot_slo_ms, pilots_n)
    return derive_slo(ttft, tpot, cfg.slo_scale, pilots=pilots_n)


def run_repeats(setup: SimSetup, specs: tuple[SystemSpec, ...], replicas: int, trace: Trace
                ) -> Repeats:
    """The pilots, the SLO, then ``cfg.repeats`` rounds of every other system (each round every
    system once, as the real bench interleaves them)."""
    cfg = setup.cfg
    pilot = tuple(s for s in specs if s.name == PILOT)  # SimBenchConfig: one where scaled
    outcomes: dict[str, list[SimOutcome]] = {}
    for k in range(cfg.repeats if pilot else 0):
        for name, o in run_systems(setup, pilot, replicas, trace, k).items():
            outcomes.setdefault(name, []).append(o)
    slo = pilot_slo(cfg, outcomes.get(PILOT, []))
    log(cfg, f"SLO {slo.describe()}")
    setup = replace(setup, slo=slo.config)
    rest = tuple(s for s in specs if s.name != PILOT)
    for k in range(cfg.repeats):
        for name, o in run_systems(setup, rest, replicas, trace, k).items():
            outcomes.setdefault(name, []).append(o)
    return Repeats(setup, slo, {s.name: outcomes[s.name] for s in specs if s.name in outcomes})


def summary(scores: list[SimScore]) -> SimScore:
    """One system's repeats as one score: the bench's summary, beside the simulation's figures
    of the repeat that trained the median tokens (``median_low``: a repeat that ran)."""
    if len(scores) == 1:
        return scores[0]
    bench = summarize([s.score for s in scores])
    median = next(s for s in scores if s.score.harvest.ft_tokens == bench.harvest.ft_tokens)
    return replace(median, score=bench)


def score_repeats(reps: Repeats, standalone_tokens_per_s: float) -> Scored:
    """Every system's repeats scored at the SLO they ran at, in report order."""
    setup, first = reps.setup, reps.first
    base = base_of(setup, first, standalone_tokens_per_s)
    names = order(tuple(o.run.spec for o in first.values()))
    scores = {n: summary([score(o, setup.slo, base) for o in reps.outcomes[n]]) for n in names}
    return Scored(reps.slo, base, scores, standalone_tokens_per_s)
