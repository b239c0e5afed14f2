"""What one system's run left behind, for the metrics and the report.

A host that replays a trace its own way (the simulated host) builds these from its own
:class:`~deltaserve.bench.replay.ReplayResult` and hands them to
:func:`deltaserve.bench.score.score_run` and the report like the bench does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltaserve.bench.latency_holdout import KindError, ModeError
from deltaserve.bench.metrics import in_window
from deltaserve.bench.replay import ReplayResult
from deltaserve.bench.systems import SystemSpec
from deltaserve.core.shape import StepShape


@dataclass(frozen=True)
class Commit:
    """One optimizer step: when it landed (``time.monotonic()`` s), its tokens and samples, and
    the tokens its trainer computed with padding (= ``num_tokens`` for packed rows)."""

    at_s: float
    num_tokens: int
    num_samples: int
    num_padded_tokens: int


@dataclass(frozen=True)
class HardwareShare:
    """How the system split the machine's ``cores`` (threads): ``host`` for the inference
    host, ``reserved`` held by training for the whole run (split-pool's trainer, a backward on
    partitioned cores); 0 reserved when training shares the host's cores."""

    cores: int
    host: int
    reserved: int


@dataclass(frozen=True)
class ReplicaRun:
    """One data-parallel replica's share of a run: its requests and steps (``result``), its
    commits, and the seconds each of its optimizer steps spent in the gradient all-reduce
    (waiting for the slowest peer included)."""

    rank: int
    result: ReplayResult
    commits: list[Commit]
    allreduce_s: list[float]


@dataclass
class SystemRun:
    """``slo_scale``: the SLO scale it ran under (None for a system that ignores the SLO).
    ``latency``: the latency model's error per execution mode, online and held out;
    ``latency_kinds``: its online error split by step kind (empty where none is kept);
    ``step_predictions``: what the latency model predicted for each step, by (shape, seconds)
    (empty where none is kept); ``latency_yields``: the error split by kind and by whether a
    yield preceded the step.
    ``replicas``: with ``--replicas`` N > 1, each replica's share; ``result`` and ``commits``
    are then the fleet's (every replica's requests, steps and commits together)."""

    spec: SystemSpec
    result: ReplayResult
    commits: list[Commit]
    latency: tuple[ModeError, ...]
    share: HardwareShare
    slo_scale: float | None = None
    adapter_dir: str | None = None
    train_log: str | None = None
    latency_kinds: tuple[KindError, ...] = ()
    step_predictions: dict[tuple[StepShape, float], float] = field(default_factory=dict)
    latency_yields: tuple[KindError, ...] = ()
    replicas: tuple[ReplicaRun, ...] = ()

    def window_commits(self, window_s: float | None = None) -> list[Commit]:
        """The commits that landed in the window of ``window_s`` seconds from the replay's
        start (None: the whole replay, for a host with no fixed window)."""
        r = self.result
        window = r.wall_s if window_s is None else window_s
        return [c for c in self.commits if in_window(c.at_s, r.start_s, window)]
