"""Everything a bench run measured, as one typed object and as ``results.json``.

``results.json`` is the artifact: the README's tables are rendered from a committed copy
(:mod:`deltaserve.bench.tables`), so its keys are a format. ``FORMAT`` names it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from deltaserve.bench.config import BenchConfig
from deltaserve.bench.fleet_score import FleetScore
from deltaserve.bench.prepare import FittedTrace
from deltaserve.bench.provenance import Provenance
from deltaserve.bench.score import (
    Binding,
    Comparison,
    HarvestBase,
    SystemScore,
    e2e_vs_inference_only,
)
from deltaserve.bench.slo import SLOChoice
from deltaserve.core.data import DatasetReport
from deltaserve.core.latency_model import FitQuality

FORMAT = "deltaserve.bench/3"


@dataclass(frozen=True)
class SweepPoint:
    """Every system scored against one SLO scale. ``scores``: by system; a system that ignores
    the SLO ran once and is scored against each scale's SLO."""

    slo: SLOChoice
    scores: dict[str, SystemScore]

    def as_json(self) -> dict:
        return {"scale": self.slo.scale, "slo": asdict(self.slo),
                "systems": {n: _sweep_row(s) for n, s in self.scores.items()}}


def _sweep_row(s: SystemScore) -> dict:
    row = {"ft_tokens_per_s": s.metrics.ft_tokens_per_s,
           "ft_tokens_in_window": s.metrics.ft_tokens_in_window,
           "slo_attainment": s.metrics.slo_attainment,
           "harvest_ratio": s.metrics.harvest_ratio, "ran_at_scale": s.slo_scale is not None}
    ranges = {k: list(r) for k in ("ft_tokens_per_s", "slo_attainment")
              if (r := s.spread(k)) is not None}
    return row | ({"range": ranges} if ranges else {})


def systems_doc(scores: dict[str, SystemScore]) -> dict:
    """Every system's score, with its end-to-end latency ÷ inference-only's (mean, p95)."""
    e2e = e2e_vs_inference_only(scores)
    return {n: s.as_json() | {"e2e_mean_vs_inference_only": e2e[n][0],
                              "e2e_p95_vs_inference_only": e2e[n][1]}
            for n, s in scores.items()}


@dataclass(frozen=True)
class Machine:
    """``load_average``: the 1-minute load average when the run started and ended (other work
    on the machine slows every system alike only if it stays constant)."""

    threads: int
    cpu_count: int | None
    cuda: bool
    host: str
    model: str
    load_average: tuple[float, float]


@dataclass(frozen=True)
class HeldoutAccuracy:
    """Exact-match accuracy on the generated task's held-out split, before and after training
    (``after`` None: no adapter was saved)."""

    before: float
    after: float | None
    system: str


@dataclass(frozen=True)
class BenchResults:
    """``main``: the systems at ``slo`` (``--slo-scale``), in report order; ``sweep``: every
    scale of ``--slo-sweep`` (empty without one). ``window_s``: the window every system's
    fine-tuning is counted in (``harvest.window_s``); ``provenance``: where the run came from
    (``COMMAND`` beside ``results.json`` is generated from it). ``replicas``: with
    ``--replicas`` N > 1, each system's replicas at the main scale (``results.json``'s
    ``replicas``; absent for one replica)."""

    trace: FittedTrace
    slo: SLOChoice
    main: SweepPoint
    binding: Binding
    comparisons: list[Comparison]
    sweep: list[SweepPoint]
    harvest: HarvestBase
    machine: Machine
    calibration: tuple[FitQuality, ...]
    dataset: DatasetReport
    dataset_path: str
    config: BenchConfig
    heldout_accuracy: HeldoutAccuracy | None = None
    wall_s: float = 0.0
    provenance: Provenance | None = None
    replicas: dict[str, FleetScore] | None = None

    def as_json(self) -> dict:
        return self._doc() | ({} if self.replicas is None else {"replicas": self._replicas()})

    def _replicas(self) -> dict:
        assert self.replicas is not None
        n = self.config.replicas
        return {"count": n, "threads_per_replica": max(1, self.machine.threads // n),
                "router": self.config.router, "repeat": 1,
                "systems": {name: f.as_json() for name, f in self.replicas.items()}}

    def _doc(self) -> dict:
        t = self.trace.trace
        prov = self.provenance.as_json() if self.provenance else {}
        return {
            "format": FORMAT,
            "commit": prov.pop("commit", None),
            "dirty": prov.pop("dirty", None),
            "provenance": prov or None,
            "window_s": self.harvest.window_s,
            "drain_s": self.config.drain_s,
            "repeats": self.config.repeats,
            "pilot_repeats": self.config.pilot_repeats,
            "trace": {"name": t.name, "source": self.config.trace, "requests": len(t),
                      "duration_s": t.duration_s, "peak_rps": t.peak_rate(),
                      "mean_rps": t.mean_rate, "rate_factor": self.trace.rate_factor,
                      "capacity_rps": self.trace.capacity_rps,
                      "length_scale": self.config.length_scale},
            "slo": asdict(self.slo) | {"text": self.slo.describe()},
            "slo_binding": self.binding.as_json(),
            "systems": systems_doc(self.main.scores),
            "comparisons": [c.as_json() for c in self.comparisons],
            "sweep": [p.as_json() for p in self.sweep],
            "harvest": self.harvest.as_json(),
            "heldout_accuracy": asdict(self.heldout_accuracy) if self.heldout_accuracy else None,
            "calibration": [{"equation": q.equation.value, "mode": q.mode.value,
                             "points": q.num_points, "mape": q.mape, "r2": q.r2}
                            for q in self.calibration],
            "dataset": asdict(self.dataset) | {"path": self.dataset_path},
            "machine": asdict(self.machine),
            "config": asdict(self.config),
            "wall_s": self.wall_s,
        }

    def write(self, path: Path) -> dict:
        """``path`` (``results.json``) and, beside it, ``COMMAND`` from the provenance."""
        doc = self.as_json()
        path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        if self.provenance is not None:
            (path.parent / "COMMAND").write_text(self.provenance.command_text())
        return doc
