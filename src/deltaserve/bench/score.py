"""A system's run scored against one SLO: the metrics, its harvest, its latency-model error,
its hardware share; and the comparisons a reader draws from a table of them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from deltaserve.bench import metrics as M
from deltaserve.bench.latency_holdout import ModeError
from deltaserve.bench.miss_source import MissSources, miss_sources
from deltaserve.bench.outcome import HardwareShare, SystemRun
from deltaserve.bench.systems import PILOT, SystemSpec
from deltaserve.core.slo import SLOConfig

MET = 0.99  # attainment at or above which a system "meets" its SLO
COMPARISONS = (
    ("deltaserve", "llmstation"),
    ("deltaserve-pipeline", "llmstation-pipeline"),
    ("deltaserve", "split-pool"),
    ("deltaserve-pipeline", "split-pool"),
    ("deltaserve-pipeline", "deltaserve"),
    ("greedy", "deltaserve"),
    ("greedy-fixed-yield", "greedy"),
    ("deltaserve-temp", "deltaserve"),
    ("deltaserve-no-interrupt", "deltaserve"),
)


@dataclass(frozen=True)
class HarvestBase:
    """The harvest's shared terms: the pilot's idle capacity and the standalone trainer's rate
    per core-second (measured on ``standalone_cores``)."""

    idle: M.IdleCapacity
    standalone_tokens_per_s: float
    standalone_cores: int

    @property
    def tokens_per_core_s(self) -> float:
        return M.tokens_per_core_s(self.standalone_tokens_per_s, self.standalone_cores)

    def as_json(self) -> dict:
        return {"cores": self.idle.cores, "pilot_wall_s": self.idle.wall_s,
                "pilot_busy_core_s": self.idle.busy_core_s,
                "idle_core_s": self.idle.idle_core_s,
                "idle_share": self.idle.idle_core_s / self.idle.total_core_s
                if self.idle.total_core_s else None,
                "standalone_tokens_per_s": self.standalone_tokens_per_s,
                "standalone_cores": self.standalone_cores,
                "standalone_tokens_per_core_s": self.tokens_per_core_s}


def harvest_base(pilot: SystemRun, standalone_tokens_per_s: float) -> HarvestBase:
    """The pilot ran its steps on every core of the machine (its host has them all)."""
    share = pilot.share
    idle = M.idle_capacity(pilot.result.steps, pilot.result.wall_s, share.cores, share.host)
    return HarvestBase(idle, standalone_tokens_per_s, share.cores)


@dataclass(frozen=True)
class SystemScore:
    """``padded_token_efficiency``: committed tokens ÷ tokens computed with padding (1 for
    packed rows; None with no commit). ``misses``: where its missed requests' late tokens fell,
    after a yield or not (None: the steps are not one host's timeline)."""

    name: str
    pair: str | None
    slo_scale: float | None
    metrics: M.SystemMetrics
    harvest: M.HarvestAccount
    latency: tuple[ModeError, ...]
    share: HardwareShare
    padded_token_efficiency: float | None
    misses: MissSources | None = None

    @property
    def meets(self) -> bool:
        return self.metrics.slo_attainment >= MET

    def as_json(self) -> dict:
        return (self.metrics.as_json()
                | {"pair": self.pair, "slo_scale": self.slo_scale,
                   "harvest": self.harvest.as_json(),
                   "latency_model_by_mode": [e.as_json() for e in self.latency],
                   "hardware_share": asdict(self.share),
                   "padded_token_efficiency": self.padded_token_efficiency,
                   "misses": self.misses.as_json() if self.misses else None})


def pooled_online_mape(errors: tuple[ModeError, ...]) -> float | None:
    """The online MAPE over every mode's steps together (a step-weighted mean of the modes')."""
    scored = [e for e in errors if e.online_mape is not None and e.online_steps]
    n = sum(e.online_steps for e in scored)
    return sum(e.online_mape * e.online_steps for e in scored) / n if n else None


def score_run(run: SystemRun, slo: SLOConfig, base: HarvestBase) -> SystemScore:
    """``run`` against ``slo``: fine-tuning counts commits inside the replay's wall time."""
    commits = run.window_commits()
    tokens = sum(c.num_tokens for c in commits)
    padded = sum(c.num_padded_tokens for c in commits)
    r = run.result
    account = M.harvest(tokens, base.idle, base.tokens_per_core_s, run.share.reserved, r.wall_s)
    metrics = M.compute(r.records, slo, r.wall_s, tokens, sum(c.num_samples for c in commits),
                        pooled_online_mape(run.latency), account.ratio)
    misses = miss_sources(r.records, r.steps, slo, [not M.meets_slo(x, slo) for x in r.records])
    return SystemScore(run.spec.name, run.spec.pair, run.slo_scale, metrics, account,
                       run.latency, run.share, tokens / padded if padded else None, misses)


@dataclass(frozen=True)
class Comparison:
    """``system``'s fine-tuning tokens/s as a multiple of ``baseline``'s, with both SLO
    attainments (a ratio means little where one of them misses)."""

    system: str
    baseline: str
    ft_ratio: float | None
    system_attainment: float
    baseline_attainment: float

    def as_json(self) -> dict:
        return asdict(self)


def comparisons(scores: Mapping[str, SystemScore]) -> list[Comparison]:
    out = []
    for a, b in COMPARISONS:
        if a in scores and b in scores:
            x, y = scores[a].metrics, scores[b].metrics
            ratio = x.ft_tokens_per_s / y.ft_tokens_per_s if y.ft_tokens_per_s > 0 else None
            out.append(Comparison(a, b, ratio, x.slo_attainment, y.slo_attainment))
    return out


@dataclass(frozen=True)
class Binding:
    """Whether the SLO tells a Δ-pricing policy from a blind one: ``binds`` when the pilot and
    ``deltaserve`` meet it and ``greedy`` misses it (None: a needed system did not run)."""

    binds: bool | None
    verdict: str

    def as_json(self) -> dict:
        return asdict(self)


def binding(scores: Mapping[str, SystemScore]) -> Binding:
    """Whether the SLO binds, and where each system that missed it missed: after a yield to the
    backward or not (admission, or inference alone)."""
    b = _binds(scores)
    where = [f"{n} {s.misses.describe()}" for n, s in scores.items()
             if s.misses is not None and s.misses.missed]
    return Binding(b.binds, f"{b.verdict}; misses: {'; '.join(where)}" if where else b.verdict)


def _binds(scores: Mapping[str, SystemScore]) -> Binding:
    def pct(name: str) -> str:
        return f"{name} {scores[name].metrics.slo_attainment:.1%}"

    if "greedy" not in scores or "deltaserve" not in scores:
        return Binding(None, "untested: run greedy and deltaserve to see whether the SLO binds")
    pilot, greedy, ds = scores[PILOT], scores["greedy"], scores["deltaserve"]
    if not pilot.meets:
        return Binding(False, f"the SLO is too tight: inference alone misses it ({pct(PILOT)})")
    if greedy.meets:
        return Binding(False, f"the SLO is too loose: greedy, which admits blind to Δ, meets it "
                              f"({pct('greedy')}; {pct('deltaserve')})")
    if not ds.meets:
        return Binding(False, f"the SLO binds, but deltaserve misses it too ({pct('deltaserve')}; "
                              f"{pct('greedy')})")
    return Binding(True, f"the SLO binds: greedy misses it ({pct('greedy')}), deltaserve meets "
                         f"it ({pct('deltaserve')})")


def order(specs: tuple[SystemSpec, ...]) -> list[str]:
    """Report order: the pilot, then each system followed by its pair where both ran."""
    names = [s.name for s in specs]
    pairs = {s.name: s.pair for s in specs}
    out: list[str] = []
    for n in names:
        if n in out:
            continue
        out.append(n)
        p = pairs[n]
        if p in names and p not in out and pairs.get(p) == n:
            out.append(p)
    return out
