"""A trace: requests with an arrival time and prompt/output lengths, and what to do with one.

``scale_rate`` keeps the burst structure: it thins (or replicates) requests with a fixed
probability, so the arrival-rate curve is multiplied by a constant and keeps its shape and its
timeline. ``scale_lengths`` multiplies and clips token counts to fit a model's context.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from deltaserve.core.errors import require


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Trace:
    name: str
    requests: tuple[TraceRequest, ...]
    duration_s: float
    source: str = "synthetic"

    def __post_init__(self) -> None:
        require(self.duration_s > 0, "duration_s", self.duration_s, "must be > 0")
        require(all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in self.requests),
                "requests", self.name, "every request needs >= 1 prompt and output token")
        arrivals = [r.arrival_s for r in self.requests]
        require(arrivals == sorted(arrivals), "requests", self.name, "must be in arrival order")

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def mean_rate(self) -> float:
        return len(self.requests) / self.duration_s

    def rate_curve(self, bin_s: float = 1.0) -> list[float]:
        """Requests per second in consecutive bins."""
        bins = [0] * max(1, math.ceil(self.duration_s / bin_s))
        for r in self.requests:
            bins[min(len(bins) - 1, int(r.arrival_s / bin_s))] += 1
        return [b / bin_s for b in bins]

    def peak_rate(self, bin_s: float = 1.0) -> float:
        return max(self.rate_curve(bin_s))

    def window(self, start_s: float, duration_s: float) -> Trace:
        """Requests arriving in ``[start_s, start_s + duration_s)``, re-timed from 0."""
        require(start_s >= 0, "start_s", start_s, "must be >= 0")
        require(duration_s > 0, "duration_s", duration_s, "must be > 0")
        end = start_s + duration_s
        kept = tuple(replace(r, arrival_s=r.arrival_s - start_s) for r in self.requests
                     if start_s <= r.arrival_s < end)
        return Trace(f"{self.name}[{start_s:g}+{duration_s:g}s]", kept, duration_s, self.source)

    def scale_rate(self, factor: float, seed: int = 0) -> Trace:
        """Multiply the arrival rate by ``factor`` everywhere: keep each request with
        probability ``factor`` (< 1), or add copies jittered within 10 ms (> 1)."""
        require(factor > 0 and math.isfinite(factor), "rate_scale", factor, "must be > 0")
        rng = random.Random(seed)
        out: list[TraceRequest] = []
        for r in self.requests:
            copies = int(factor) + (1 if rng.random() < factor - int(factor) else 0)
            for c in range(copies):
                t = r.arrival_s if c == 0 else min(self.duration_s - 1e-6,
                                                   r.arrival_s + rng.uniform(0, 0.01))
                out.append(replace(r, arrival_s=t))
        out.sort(key=lambda r: r.arrival_s)
        return Trace(f"{self.name}x{factor:.3g}", tuple(out), self.duration_s, self.source)

    def scale_lengths(self, factor: float = 1.0, *, max_prompt: int | None = None,
                      max_output: int | None = None, max_total: int | None = None) -> Trace:
        """Multiply token counts by ``factor`` and clip them (prompt first, then output, so that
        prompt + output <= ``max_total``)."""
        require(factor > 0, "length_scale", factor, "must be > 0")
        out = []
        for r in self.requests:
            p = max(1, round(r.prompt_tokens * factor))
            o = max(1, round(r.output_tokens * factor))
            if max_prompt is not None:
                p = min(p, max_prompt)
            if max_output is not None:
                o = min(o, max_output)
            if max_total is not None:
                p = min(p, max_total - 1)
                o = max(1, min(o, max_total - p))
            out.append(replace(r, prompt_tokens=p, output_tokens=o))
        return Trace(self.name, tuple(out), self.duration_s, self.source)


def from_arrivals(name: str, arrivals: Sequence[float], prompts: Sequence[int],
                  outputs: Sequence[int], duration_s: float, source: str) -> Trace:
    reqs = sorted((TraceRequest(float(a), int(p), int(o))
                   for a, p, o in zip(arrivals, prompts, outputs, strict=True)),
                  key=lambda r: r.arrival_s)
    return Trace(name, tuple(reqs), duration_s, source)
