"""Deterministic synthetic traces (seeded), after the paper's evaluation workloads.

Arrivals are an inhomogeneous Poisson process whose rate is piecewise constant on 100 ms bins.

* ``burst-light`` (60 s): every 6 s, a 2 s peak at 80 req/s, then 4 s at 1 req/s.
* ``burst-dense`` (60 s): every 6 s, a 4 s peak at 120 req/s, then 2 s at 2 req/s.
* ``production`` (20 min): a base load of ~6 req/s swinging ±60 % over 5-minute periods; four
  near-idle stretches of 1–2.5 min at 0.2 req/s; bursts arriving every ~40 s on average with
  Pareto(α=1.5) peak rates (×15 req/s, capped at 200) lasting Exp(mean 6 s); and three spikes
  above 100 req/s.

Lengths (all traces): prompt tokens ~ LogNormal(median 512, σ 0.9) clipped to [16, 4096];
output tokens ~ LogNormal(median 128, σ 0.8) clipped to [4, 1024]. Heavy-tailed, like
production LLM traffic; scale them to a small model with ``Trace.scale_lengths``.
"""

from __future__ import annotations

import numpy as np

from deltaserve.core.errors import InputError
from deltaserve.workloads.trace import Trace, from_arrivals

BIN_S = 0.1
SYNTHETIC = ("burst-light", "burst-dense", "production")


def _lengths(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    prompts = np.clip(rng.lognormal(np.log(512), 0.9, n), 16, 4096).round().astype(int)
    outputs = np.clip(rng.lognormal(np.log(128), 0.8, n), 4, 1024).round().astype(int)
    return prompts, outputs


def _arrivals(rng: np.random.Generator, rate: np.ndarray) -> np.ndarray:
    counts = rng.poisson(rate * BIN_S)
    starts = np.repeat(np.arange(len(rate)) * BIN_S, counts)
    return np.sort(starts + rng.uniform(0, BIN_S, counts.sum()))


def _periodic(duration_s: float, period_s: float, peak_s: float, peak: float, low: float
              ) -> np.ndarray:
    t = np.arange(round(duration_s / BIN_S)) * BIN_S
    return np.where((t % period_s) < peak_s, peak, low)


def _production_rate(rng: np.random.Generator, duration_s: float) -> np.ndarray:
    n = round(duration_s / BIN_S)
    t = np.arange(n) * BIN_S
    rate = 6.0 * (1 + 0.6 * np.sin(2 * np.pi * t / 300 + rng.uniform(0, 2 * np.pi)))
    for _ in range(4):  # long near-zero stretches
        start = rng.uniform(0, duration_s - 150)
        rate[(t >= start) & (t < start + rng.uniform(60, 150))] = 0.2
    start = 0.0
    while True:  # multi-scale bursts with heavy-tailed peaks
        start += rng.exponential(40.0)
        if start >= duration_s:
            break
        peak = min(200.0, 15.0 * (rng.pareto(1.5) + 1))
        rate[(t >= start) & (t < start + rng.exponential(6.0))] += peak
    for start in rng.uniform(0, duration_s - 5, 3):  # spikes above 100 req/s
        rate[(t >= start) & (t < start + rng.uniform(1, 3))] += rng.uniform(110, 160)
    return rate


def generate(name: str, *, seed: int = 0, duration_s: float | None = None) -> Trace:
    rng = np.random.default_rng(seed)
    if name == "burst-light":
        duration_s = duration_s or 60.0
        rate = _periodic(duration_s, 6.0, 2.0, 80.0, 1.0)
    elif name == "burst-dense":
        duration_s = duration_s or 60.0
        rate = _periodic(duration_s, 6.0, 4.0, 120.0, 2.0)
    elif name == "production":
        duration_s = duration_s or 1200.0
        rate = _production_rate(rng, duration_s)
    else:
        raise InputError("trace", name, f"unknown synthetic trace; known: {', '.join(SYNTHETIC)}")
    arrivals = _arrivals(rng, rate)
    prompts, outputs = _lengths(rng, len(arrivals))
    return from_arrivals(name, arrivals, prompts, outputs, duration_s, "synthetic")
