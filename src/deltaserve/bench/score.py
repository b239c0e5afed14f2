"""A system's run scored against one SLO: the metrics, its harvest, its latency-model error,
its hardware share; and the comparisons a reader draws from a table of them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from deltaserve.bench import metrics as M
from deltaserve.bench.latency_holdout import KindError, ModeError
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
    per core-second (measured on ``standalone_cores``). ``window_s``: the window every system is
    scored over, the idle capacity's span (the real and the simulated bench both give one; None:
    each run's own replay); ``pilot_wall_s``: the pilot's own wall time
    (None: the idle capacity's span)."""

    idle: M.IdleCapacity
    standalone_tokens_per_s: float
    standalone_cores: int
    window_s: float | None = None
    pilot_wall_s: float | None = None

    @property
    def tokens_per_core_s(self) -> float:
        return M.tokens_per_core_s(self.standalone_tokens_per_s, self.standalone_cores)

    def as_json(self) -> dict:
        return {"cores": self.idle.cores, "window_s": self.window_s,
                "span_s": self.idle.wall_s, "total_core_s": self.idle.total_core_s,
                "pilot_wall_s": self.idle.wall_s if self.pilot_wall_s is None
                else self.pilot_wall_s,
                "pilot_busy_core_s": self.idle.busy_core_s,
                "idle_core_s": self.idle.idle_core_s,
                "idle_share": self.idle.idle_core_s / self.idle.total_core_s
                if self.idle.total_core_s else None,
                "standalone_tokens_per_s": self.standalone_tokens_per_s,
                "standalone_cores": self.standalone_cores,
                "standalone_tokens_per_core_s": self.tokens_per_core_s}


def harvest_base(pilot: SystemRun, standalone_tokens_per_s: float,
                 window_s: float | None = None) -> HarvestBase:
    """The pilot ran its steps on every core of the machine (its host has them all). With
    ``window_s``, its idle capacity is counted over the window (its steps in it, its drained
    tail idle); without, over its own replay."""
    share, r = pilot.share, pilot.result
    if window_s is None:
        idle = M.idle_capacity(r.steps, r.wall_s, share.cores, share.host)
    else:
        idle = M.idle_capacity(r.steps, window_s, share.cores, share.host,
                               end_s=r.start_s + window_s)
    return HarvestBase(idle, standalone_tokens_per_s, share.cores, window_s, r.wall_s)


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
    drained_s: float | None = None
    runs: tuple[M.SystemMetrics, ...] = ()
    latency_kinds: tuple[KindError, ...] = ()
    latency_yields: tuple[KindError, ...] = ()

    @property
    def meets(self) -> bool:
        return self.metrics.slo_attainment >= MET

    def spread(self, metric: str) -> tuple[float, float] | None:
        """The min and max of ``metric`` over the repeats (None: one run, or no value)."""
        values = [v for v in (getattr(m, metric) for m in self.runs) if v is not None]
        return (min(values), max(values)) if len(self.runs) > 1 and values else None

    def as_json(self) -> dict:
        doc = (self.metrics.as_json()
               | {"pair": self.pair, "slo_scale": self.slo_scale,
                  "harvest": self.harvest.as_json(),
                  "latency_model_by_mode": [e.as_json() for e in self.latency],
                  "latency_model_by_kind": [e.as_json() for e in self.latency_kinds],
                  "latency_model_by_yield": [e.as_json() for e in self.latency_yields],
                  "hardware_share": asdict(self.share),
                  "padded_token_efficiency": self.padded_token_efficiency,
                  "drained_s": self.drained_s, "repeats": max(1, len(self.runs)),
                   "misses": self.misses.as_json() if self.misses else None})
        if len(self.runs) > 1:  # the range of the rounded figures ``runs`` lists
            runs = [m.as_json() for m in self.runs]
            doc["range"] = {k: [min(vs), max(vs)] for k in runs[0]
                            if (vs := [r[k] for r in runs if r[k] is not None])}
            doc["runs"] = runs
        return doc


def pooled_online_mape(errors: tuple[ModeError, ...]) -> float | None:
    """The online MAPE over every mode's steps together (a step-weighted mean of the modes')."""
    scored = [e for e in errors if e.online_mape is not None and e.online_steps]
    n = sum(e.online_steps for e in scored)
    return sum(e.online_mape * e.online_steps for e in scored) / n if n else None


def score_run(run: SystemRun, slo: SLOConfig, base: HarvestBase) -> SystemScore:
    """``run`` against ``slo``: fine-tuning counts the commits in ``base``'s window (every
    system the same; without one, the run's own replay); attainment every request."""
    r = run.result
    window = r.wall_s if base.window_s is None else base.window_s
    commits = run.window_commits(window)
    tokens = sum(c.num_tokens for c in commits)
    padded = sum(c.num_padded_tokens for c in commits)
    account = M.harvest(tokens, base.idle, base.tokens_per_core_s, run.share.reserved, window)
    metrics = M.compute(r.records, slo, window, tokens, sum(c.num_samples for c in commits),
                        pooled_online_mape(run.latency), account.ratio)
    misses = miss_sources(r.records, r.steps, slo, [not M.meets_slo(x, slo) for x in r.records],
                          run.step_predictions)
    return SystemScore(run.spec.name, run.spec.pair, run.slo_scale, metrics, account,
                       run.latency, run.share, tokens / padded if padded else None,
                       misses, r.drained_s, latency_kinds=run.latency_kinds,
                       latency_yields=run.latency_yields)


def overlaps(a: tuple[float, float] | None, b: tuple[float, float] | None) -> bool | None:
    """Whether two repeat ranges overlap, so the medians' margin is within the noise the
    repeats showed (None: a side ran once)."""
    if a is None or b is None:
        return None
    return a[0] <= b[1] and b[0] <= a[1]


@dataclass(frozen=True)
class Comparison:
    """``system``'s fine-tuning tokens/s as a multiple of ``baseline``'s, with both SLO
    attainments (a ratio means little where one of them misses). With repeats: the medians'
    ratio; ``within_range``: the two systems' tokens/s ranges overlap (None: one run)."""

    system: str
    baseline: str
    ft_ratio: float | None
    system_attainment: float
    baseline_attainment: float
    within_range: bool | None = None

    def as_json(self) -> dict:
        return asdict(self)


def comparisons(scores: Mapping[str, SystemScore]) -> list[Comparison]:
    out = []
    for a, b in COMPARISONS:
        if a in scores and b in scores:
            x, y = scores[a].metrics, scores[b].metrics
            ratio = x.ft_tokens_per_s / y.ft_tokens_per_s if y.ft_tokens_per_s > 0 else None
            out.append(Comparison(a, b, ratio, x.slo_attainment, y.slo_attainment,
                                  overlaps(scores[a].spread("ft_tokens_per_s"),
                                           scores[b].spread("ft_tokens_per_s"))))
    return out


@dataclass(frozen=True)
class Binding:
    """Whether the SLO tells a Δ-pricing policy from a blind one: ``binds`` when the pilot and
    ``deltaserve`` meet it and ``greedy`` misses it (None: a needed system did not run). With
    repeats the verdict is the medians'; it says so where a repeat's attainment falls on the
    other side of the mark."""

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


def _pct(score: SystemScore) -> str:
    text = f"{score.name} {score.metrics.slo_attainment:.1%}"
    r = score.spread("slo_attainment")
    return text if r is None else f"{text} (range {r[0]:.1%}–{r[1]:.1%})"


def _split(scores: list[SystemScore]) -> str:
    """The systems whose repeats fall on both sides of the mark, said in the verdict."""
    names = [s.name for s in scores
             if (r := s.spread("slo_attainment")) is not None and r[0] < MET <= r[1]]
    return (f"; within the repeats' range: {', '.join(names)} met it in some repeats, not in "
            f"others") if names else ""


def _binds(scores: Mapping[str, SystemScore]) -> Binding:
    if "greedy" not in scores or "deltaserve" not in scores:
        return Binding(None, "untested: run greedy and deltaserve to see whether the SLO binds")
    pilot, greedy, ds = scores[PILOT], scores["greedy"], scores["deltaserve"]
    note = _split([pilot, greedy, ds])
    if not pilot.meets:
        return Binding(False, f"the SLO is too tight: inference alone misses it ({_pct(pilot)})"
                              f"{note}")
    if greedy.meets:
        return Binding(False, f"the SLO is too loose: greedy, which admits blind to Δ, meets it "
                              f"({_pct(greedy)}; {_pct(ds)}){note}")
    if not ds.meets:
        return Binding(False, f"the SLO binds, but deltaserve misses it too ({_pct(ds)}; "
                              f"{_pct(greedy)}){note}")
    return Binding(True, f"the SLO binds: greedy misses it ({_pct(greedy)}), deltaserve meets "
                         f"it ({_pct(ds)}){note}")


def e2e_vs_inference_only(scores: Mapping[str, SystemScore]
                          ) -> dict[str, tuple[float | None, float | None]]:
    """Each system's mean and p95 end-to-end latency ÷ inference-only's (None where a side has
    no value, or inference-only was not scored)."""
    base = scores.get(PILOT)

    def ratio(v: float | None, ref: float | None) -> float | None:
        return v / ref if v is not None and ref else None

    if base is None:
        return {n: (None, None) for n in scores}
    b = base.metrics
    return {n: (ratio(s.metrics.mean_e2e_s, b.mean_e2e_s), ratio(s.metrics.e2e_p95_s, b.e2e_p95_s))
            for n, s in scores.items()}


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
