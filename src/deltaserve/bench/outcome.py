"""What one system's run left behind, for the metrics and the report."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.bench.replay import ReplayResult
from deltaserve.bench.systems import SystemSpec


@dataclass
class SystemRun:
    """``ft_commits``: (``time.monotonic()`` s, tokens, samples) of each optimizer step.
    ``mape_by_mode``: the latency model's out-of-sample error per execution mode."""

    spec: SystemSpec
    result: ReplayResult
    ft_commits: list[tuple[float, int, int]]
    mape_by_mode: dict[str, float]
    adapter_dir: str | None = None
    train_log: str | None = None
