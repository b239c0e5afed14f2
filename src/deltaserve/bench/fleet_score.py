"""Each data-parallel replica's share of a ``--replicas`` run, and the fleet's totals
(:mod:`deltaserve.bench.replicas` forms the replicas)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from deltaserve.bench import metrics as M
from deltaserve.bench.config import BenchConfig
from deltaserve.bench.outcome import SystemRun
from deltaserve.bench.prepare import log
from deltaserve.core.slo import SLOConfig


@dataclass(frozen=True)
class ReplicaScore:
    rank: int
    requests: int
    slo_attainment: float
    ft_tokens_in_window: int
    ft_tokens_per_s: float


@dataclass(frozen=True)
class FleetScore:
    """One system's replicas: each one's share, the totals (FT tokens/s: the replicas' sum;
    SLO attainment: over every request, the replicas' request-weighted mean) and the seconds
    each optimizer step spent in the all-reduce, over every replica's steps (a fast replica's
    wait for its slowest peer included): median and p90 (None: no step)."""

    replicas: tuple[ReplicaScore, ...]
    slo_attainment: float
    ft_tokens_in_window: int
    ft_tokens_per_s: float
    allreduce_steps: int
    allreduce_s_median: float | None
    allreduce_s_p90: float | None

    def as_json(self) -> dict:
        return asdict(self)


def fleet_score(run: SystemRun, slo: SLOConfig, window_s: float) -> FleetScore:
    """``run``'s replicas against ``slo``, fine-tuning counted in the window of ``window_s``
    seconds from the replay's start (the bench's one window)."""
    scores = []
    for rep in run.replicas:
        r = rep.result
        tokens = sum(c.num_tokens for c in rep.commits
                     if M.in_window(c.at_s, r.start_s, window_s))
        scores.append(ReplicaScore(rep.rank, len(r.records), M.attainment(r.records, slo),
                                   tokens, tokens / window_s))
    total = sum(s.ft_tokens_in_window for s in scores)
    reduce_s = [s for rep in run.replicas for s in rep.allreduce_s]
    return FleetScore(tuple(scores), M.attainment(run.result.records, slo), total,
                      total / window_s, len(reduce_s),
                      float(np.median(reduce_s)) if reduce_s else None,
                      float(np.percentile(reduce_s, 90)) if reduce_s else None)


def announce(cfg: BenchConfig, name: str, fleet: FleetScore) -> None:
    for s in fleet.replicas:
        log(cfg, f"{name} replica {s.rank}: {s.ft_tokens_per_s:.1f} FT tokens/s, SLO "
                 f"attainment {s.slo_attainment:.1%} over {s.requests} requests")
    if fleet.allreduce_s_median is not None:
        log(cfg, f"{name}: all-reduce {fleet.allreduce_s_median * 1e3:.1f} ms per step "
                 f"(median; p90 {(fleet.allreduce_s_p90 or 0) * 1e3:.1f} ms) over "
                 f"{fleet.allreduce_steps} replica-steps")
