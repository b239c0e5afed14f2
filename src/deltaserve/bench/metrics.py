"""Per-system metrics of one replay.

* SLO attainment: a request meets its SLO when it finished, its TTFT (from its scheduled
  arrival) is within the TTFT objective and its longest gap between two tokens is within the
  TPOT objective.
* ``tpot_p99_ms``: the 99th percentile, over requests, of that longest gap.
* Fine-tuning throughput: tokens and samples the backward *committed* in the run's window,
  per second of that window. The window is the same for every system: from the replay's start,
  the trace's duration plus one fixed drain (``BenchConfig.drain_s``). Training is recorded
  until the window closes even where a system's requests drained earlier; a commit after it
  does not count, while SLO attainment still scores every request, however late it finished.
  (Each system's own wall time was the window before: a system that delayed inference ran
  longer, at low load, and trained more for it.)
* End-to-end latency: scheduled arrival to last token, mean and p95 over finished requests.

Harvest ratio, accounted in core-seconds (device-seconds on a GPU: read "core" as "device")
over the window ``W``::

    idle_core_s     = C · W − Σⱼ sⱼ · cⱼ                                       [core·s]
    reserved_core_s = c_r · W                                                 [core·s]
    rate            = standalone training tokens/s on k cores ÷ k             [tokens/(core·s)]
    harvest         = ft_tokens ÷ ((idle_core_s + reserved_core_s) · rate)    [1]

* ``C``: cores of the whole machine; ``W`` [s]: the window; ``sⱼ`` [s]: time of the
  inference-only run's step ``j`` inside the window and ``cⱼ`` the cores that step ran on (all
  ``C`` for the bare host). ``idle_core_s`` is what inference alone left unused on the whole
  machine over the window (its drained tail included).
* ``c_r``: cores the system reserved for training and so took from inference for the whole
  window: split-pool's trainer, a backward on a partitioned core. 0 for a system whose training
  only shares the host's cores (it is then charged the idle capacity alone).
* ``ft_tokens``: fine-tuning tokens the system committed in the window.

The denominator is the training the capacity the system spent could have bought at the
standalone rate. Every term is over the same ``W`` for every system, so sanity holds by
construction: inference-only scores 0; a system that only stretches its run (the same commits,
its last requests later) scores the same; a system training only in the measured idle gaps
scores ``ft_tokens ÷ (idle_core_s · rate)``; a split pool is charged its trainer's cores for
the whole window *on top of* the idle capacity (which it leaves unused), so it scores at most
what those cores could train at the standalone rate, ``c_r · W · rate ÷ ((idle_core_s +
c_r · W) · rate) ≤ 1``. The charge is deliberately conservative: a reserved core's own idle
share of the inference-only run is in both terms.

The definition still allows a value above 1. It then means the system trained more than a
standalone trainer could have in the capacity charged to it, which happens when (a) training
rows ride inside inference steps whose marginal cost per row is below a standalone trainer's (a
memory-bound GPU step: that capacity is not idle by this account, yet it trains), (b) training
runs on fewer cores than the standalone measurement and threads scale sub-linearly (more tokens
per core-second), or (c) the system slowed inference without reserving cores (a backward
time-sliced with the host): SLO attainment then shows the cost.

(An older ratio, standalone tokens/s × the idle share of the wall time, ignored reserved cores,
so a split pool that harvests no idle time scored 2.33; it is gone.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from deltaserve.bench.replay import RequestRecord
from deltaserve.core.contract import StepRecord
from deltaserve.core.errors import require
from deltaserve.core.slo import SLOConfig


@dataclass(frozen=True)
class SystemMetrics:
    """``ft_tokens_in_window``: the tokens committed in the window; ``ft_tokens_per_s`` is it
    over the window's seconds."""

    ft_tokens_per_s: float
    ft_samples_per_s: float
    slo_attainment: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p99_ms: float | None
    mean_e2e_s: float | None
    completed_requests: int
    latency_model_mape: float | None
    harvest_ratio: float | None
    ft_tokens_in_window: int = 0
    e2e_p95_s: float | None = None

    def as_json(self) -> dict:
        return {k: (None if v is None else round(v, 6) if isinstance(v, float) else v)
                for k, v in asdict(self).items()}


def meets_slo(rec: RequestRecord, slo: SLOConfig) -> bool:
    return (rec.finished and rec.ttft_s is not None and rec.ttft_s <= slo.ttft_s
            and rec.max_tpot_s <= slo.tpot_s)


def attainment(records: Sequence[RequestRecord], slo: SLOConfig) -> float:
    return float(np.mean([meets_slo(r, slo) for r in records])) if records else 1.0


def _pct(values: list[float], q: float, scale: float = 1.0) -> float | None:
    return float(np.percentile(values, q)) * scale if values else None


def p99_latencies_ms(records: Sequence[RequestRecord]) -> tuple[float | None, float | None]:
    """p99 TTFT and p99 longest token gap (finished requests), in ms: what an SLO derives from."""
    ttft = [r.ttft_s for r in records if r.ttft_s is not None]
    tpot = [r.max_tpot_s for r in records if r.finished]
    return _pct(ttft, 99, 1e3), _pct(tpot, 99, 1e3)


def in_window(at_s: float, start_s: float, window_s: float) -> bool:
    """Whether a commit at ``at_s`` landed in the window of ``window_s`` seconds from
    ``start_s`` (both ends included)."""
    return start_s <= at_s <= start_s + window_s


def window_tokens(commits: Sequence[tuple[float, int]], start_s: float, window_s: float) -> int:
    """The tokens of the ``(at_s, num_tokens)`` commits that landed in the window; later ones,
    however many, do not count."""
    require(window_s > 0, "window_s", window_s, "must be > 0")
    return sum(n for at, n in commits if in_window(at, start_s, window_s))


@dataclass(frozen=True)
class IdleCapacity:
    """What the inference-only run left unused on the whole machine: ``cores`` × ``wall_s``
    (the window) less ``busy_core_s``, the core-seconds its steps ran in it."""

    cores: int
    wall_s: float
    busy_core_s: float

    @property
    def total_core_s(self) -> float:
        return self.cores * self.wall_s

    @property
    def idle_core_s(self) -> float:
        # steps are timed inside the wall clock; rounding can make busy exceed it by a hair
        return max(0.0, self.total_core_s - self.busy_core_s)


def idle_capacity(steps: Sequence[StepRecord], wall_s: float, cores: int,
                  step_cores: int | None = None, end_s: float | None = None) -> IdleCapacity:
    """The inference-only run's idle capacity: its ``steps`` each ran on ``step_cores`` of the
    machine's ``cores`` (default: all of them) during ``wall_s`` seconds (the window). With
    ``end_s``, the window's end on the steps' clock, a step that ends after it counts only its
    part before it (a step's ``t_s`` is its end)."""
    require(cores >= 1, "cores", cores, "must be >= 1")
    step_cores = cores if step_cores is None else step_cores
    require(1 <= step_cores <= cores, "step_cores", step_cores, f"must be in [1, {cores}]")
    require(wall_s >= 0, "wall_s", wall_s, "must be >= 0")
    if end_s is None:
        busy_s = sum(s.seconds for s in steps)
    else:
        busy_s = sum(min(s.seconds, max(0.0, end_s - (s.t_s - s.seconds))) for s in steps)
    return IdleCapacity(cores, wall_s, busy_s * step_cores)


def tokens_per_core_s(tokens_per_s: float, cores: int) -> float:
    """A standalone trainer's throughput on ``cores`` cores, per core-second."""
    require(cores >= 1, "cores", cores, "must be >= 1")
    require(tokens_per_s >= 0, "standalone_tokens_per_s", tokens_per_s, "must be >= 0")
    return tokens_per_s / cores


@dataclass(frozen=True)
class HarvestAccount:
    """One system's harvest, with every term of the module docstring's formula."""

    ft_tokens: int
    idle_core_s: float
    reserved_core_s: float
    standalone_tokens_per_core_s: float

    @property
    def training_core_s(self) -> float:
        """The capacity charged to training: the idle capacity plus the reserved cores."""
        return self.idle_core_s + self.reserved_core_s

    @property
    def ratio(self) -> float | None:
        """``None`` when nothing was charged (no idle capacity, no reserved core) or the
        standalone rate is unknown (0)."""
        denom = self.training_core_s * self.standalone_tokens_per_core_s
        return self.ft_tokens / denom if denom > 0 else None

    def as_json(self) -> dict:
        return asdict(self) | {"training_core_s": self.training_core_s, "ratio": self.ratio}


def harvest(ft_tokens: int, idle: IdleCapacity, standalone_tokens_per_core_s: float,
            reserved_cores: int = 0, window_s: float = 0.0) -> HarvestAccount:
    """Harvest of a system that committed ``ft_tokens`` in the window of ``window_s`` seconds
    and held ``reserved_cores`` of the machine for training throughout (split-pool's trainer, a
    partitioned backward), against the inference-only run's ``idle`` capacity over the same
    window."""
    require(ft_tokens >= 0, "ft_tokens", ft_tokens, "must be >= 0")
    require(0 <= reserved_cores <= idle.cores, "reserved_cores", reserved_cores,
            f"must be in [0, {idle.cores}] (the machine's cores)")
    require(window_s >= 0, "window_s", window_s, "must be >= 0")
    require(reserved_cores == 0 or window_s > 0, "window_s", window_s,
            "a system holding reserved cores needs the window to be charged")
    require(standalone_tokens_per_core_s >= 0, "standalone_tokens_per_core_s",
            standalone_tokens_per_core_s, "must be >= 0")
    return HarvestAccount(ft_tokens, idle.idle_core_s, reserved_cores * window_s,
                          standalone_tokens_per_core_s)


def compute(records: Sequence[RequestRecord], slo: SLOConfig, window_s: float, ft_tokens: int,
            ft_samples: int, latency_model_mape: float | None,
            harvest: float | None = None) -> SystemMetrics:
    """``ft_tokens`` and ``ft_samples``: committed in the window of ``window_s`` seconds;
    latency and attainment: every request of ``records``, whenever it finished."""
    ttft = [r.ttft_s for r in records if r.ttft_s is not None]
    ttft_p99_ms, tpot_p99_ms = p99_latencies_ms(records)
    e2e = [r.e2e_s for r in records if r.e2e_s is not None]
    return SystemMetrics(
        ft_tokens_per_s=ft_tokens / window_s if window_s > 0 else 0.0,
        ft_samples_per_s=ft_samples / window_s if window_s > 0 else 0.0,
        slo_attainment=attainment(records, slo),
        ttft_p50_ms=_pct(ttft, 50, 1e3),
        ttft_p99_ms=ttft_p99_ms,
        tpot_p99_ms=tpot_p99_ms,
        mean_e2e_s=float(np.mean(e2e)) if e2e else None,
        completed_requests=sum(r.finished for r in records),
        latency_model_mape=latency_model_mape,
        harvest_ratio=harvest,
        ft_tokens_in_window=ft_tokens,
        e2e_p95_s=_pct(e2e, 95),
    )
