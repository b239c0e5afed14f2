"""Per-system metrics of one replay.

* SLO attainment: a request meets its SLO when it finished, its TTFT (from its scheduled
  arrival) is within the TTFT objective and its longest gap between two tokens is within the
  TPOT objective.
* ``tpot_p99_ms``: the 99th percentile, over requests, of that longest gap.
* Fine-tuning throughput: tokens and samples the backward *committed* during the replay's wall
  time, per second.
* Harvest ratio: fine-tuning tokens/s ÷ (standalone training tokens/s of the whole machine ×
  the fraction of the inference-only run's wall time in which the machine had no step to run).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from deltaserve.bench.replay import RequestRecord
from deltaserve.core.contract import StepRecord
from deltaserve.core.slo import SLOConfig


@dataclass(frozen=True)
class SystemMetrics:
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


def idle_fraction(steps: Sequence[StepRecord], wall_s: float) -> float:
    """Share of the wall time with no step running."""
    busy = sum(s.seconds for s in steps)
    return max(0.0, 1.0 - busy / wall_s) if wall_s > 0 else 0.0


def harvest_ratio(ft_tokens_per_s: float, standalone_tokens_per_s: float,
                  inference_idle_fraction: float) -> float | None:
    denom = standalone_tokens_per_s * inference_idle_fraction
    return ft_tokens_per_s / denom if denom > 0 else None


def compute(records: Sequence[RequestRecord], slo: SLOConfig, wall_s: float, ft_tokens: int,
            ft_samples: int, latency_model_mape: float | None,
            harvest: float | None = None) -> SystemMetrics:
    ttft = [r.ttft_s for r in records if r.ttft_s is not None]
    tpot = [r.max_tpot_s for r in records if r.finished]
    e2e = [r.e2e_s for r in records if r.e2e_s is not None]
    return SystemMetrics(
        ft_tokens_per_s=ft_tokens / wall_s if wall_s > 0 else 0.0,
        ft_samples_per_s=ft_samples / wall_s if wall_s > 0 else 0.0,
        slo_attainment=attainment(records, slo),
        ttft_p50_ms=_pct(ttft, 50, 1e3),
        ttft_p99_ms=_pct(ttft, 99, 1e3),
        tpot_p99_ms=_pct(tpot, 99, 1e3),
        mean_e2e_s=float(np.mean(e2e)) if e2e else None,
        completed_requests=sum(r.finished for r in records),
        latency_model_mape=latency_model_mape,
        harvest_ratio=harvest,
    )
