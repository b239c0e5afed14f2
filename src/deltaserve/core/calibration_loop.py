"""The calibration loop, written once for every host: build the plan for the host's limits
(:func:`~deltaserve.core.calibration.build_plan`), have the host's prober time each probe,
record the median of each timing in a latency model, fit it.

A host supplies only its :class:`Prober`: how one planned probe runs through its own scheduling
and forward path (warm-up runs, the modes it runs a probe in, set-up and release of the probe's
requests). The loop owns the plan, the progress display, the samples and the fit.

Two ways to time a probe, one loop:

* :class:`Prober` (the embedded engine, SGLang, the simulated host) times a probe when asked and
  returns its timings: :func:`run_calibration` runs the whole plan at once.
* :class:`SteppedProber` (vLLM) cannot run a step when it likes: the engine loop steps the
  scheduler, and the probe's requests run when it does. Its ``time`` is a generator that yields
  whenever it waits for a host step and is sent that step's result; :func:`calibration_steps` is
  the loop as such a generator, advanced by whoever steps the host.
"""

from __future__ import annotations

import statistics
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from tqdm import tqdm

from deltaserve.core.calibration import CalibrationConfig, CalibrationProbe, HostLimits, build_plan
from deltaserve.core.errors import require
from deltaserve.core.latency_model import LatencyModel, LatencyModelConfig
from deltaserve.core.shape import StepShape

StepT = TypeVar("StepT", contravariant=True)  # what a stepped host sends back for one step
SentT = TypeVar("SentT")


@dataclass(frozen=True)
class ProbeTiming:
    """One way a host ran one probe: the shape it reports having run (the mode it really used
    included) and the seconds of each timed repeat, warm-up runs left out. The loop records
    their median: one slow run (another process on the core) is not the shape."""

    shape: StepShape
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        require(len(self.seconds) >= 1, "seconds", self.seconds, "needs one timed run or more")

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


class Prober(Protocol):
    """How a host times one planned probe, on the spot.

    ``open`` runs once before the first probe, with the whole plan (a stand-in training adapter
    loaded, a capture buffer sized; it raises if the host is busy); ``close`` runs once after the
    last, also when ``open`` or a probe failed or the loop was abandoned. ``time`` returns one
    timing per way the host ran the probe (a graph host runs a decode-only probe replayed and
    eager), none if it skipped it."""

    @property
    def limits(self) -> HostLimits: ...

    def open(self, plan: Sequence[CalibrationProbe]) -> None: ...

    def time(self, probe: CalibrationProbe) -> Sequence[ProbeTiming]: ...

    def close(self) -> None: ...


class SteppedProber(Protocol[StepT]):
    """A :class:`Prober` whose host steps on its own schedule: ``time`` yields each time it
    waits for a host step and is sent that step's result (a ``StepT``)."""

    @property
    def limits(self) -> HostLimits: ...

    def open(self, plan: Sequence[CalibrationProbe]) -> None: ...

    def time(self, probe: CalibrationProbe
             ) -> Generator[None, StepT, Sequence[ProbeTiming]]: ...

    def close(self) -> None: ...


def calibration_steps(prober: SteppedProber[SentT], config: CalibrationConfig | None = None,
                      latency: LatencyModelConfig | None = None, *, progress: bool = True
                      ) -> Generator[None, SentT, LatencyModel]:
    """The calibration loop: every probe of the plan for ``prober.limits`` timed by
    ``prober``, the median of each timing added to a latency model, which is fitted and
    returned. A generator that yields whenever the prober waits for a host step."""
    plan = build_plan(prober.limits, config)
    model = LatencyModel(latency)
    try:
        prober.open(plan)
        for probe in tqdm(plan, desc="calibrating", unit="probe", disable=not progress):
            for timing in (yield from prober.time(probe)):
                model.add_calibration(timing.shape, timing.median_s)
    finally:
        prober.close()
    model.fit()
    return model


def run_calibration(prober: Prober, config: CalibrationConfig | None = None,
              latency: LatencyModelConfig | None = None, *, progress: bool = True
              ) -> LatencyModel:
    """:func:`calibration_steps` for a prober that times each probe when asked: it never waits
    for a host step, so the loop runs to its end at once."""
    steps = calibration_steps(_OnTheSpot(prober), config, latency, progress=progress)
    try:
        next(steps)
    except StopIteration as done:
        model: LatencyModel = done.value
        return model
    steps.close()
    raise AssertionError("a prober that times on the spot waited for a host step")


class _OnTheSpot:
    """A :class:`Prober` as a :class:`SteppedProber` that never waits for a step."""

    def __init__(self, prober: Prober):
        self.prober = prober

    @property
    def limits(self) -> HostLimits:
        return self.prober.limits

    def open(self, plan: Sequence[CalibrationProbe]) -> None:
        self.prober.open(plan)

    def time(self, probe: CalibrationProbe) -> Generator[None, object, Sequence[ProbeTiming]]:
        return self.prober.time(probe)
        yield  # unreachable: makes this a generator that returns without waiting for a step

    def close(self) -> None:
        self.prober.close()
