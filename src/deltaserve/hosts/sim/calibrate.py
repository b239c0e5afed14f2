"""Calibration on a simulated host: the same loop and plan a real host runs
(:mod:`deltaserve.core.calibration_loop`), each probe timed by the oracle with its run-to-run
noise, the median of its repeats fitted by the same latency model. Its error against the oracle
is therefore measured (``LatencyModel.quality``, and online during a run), not assumed. No
warm-up run: a simulated step has no caches to warm."""

from __future__ import annotations

from collections.abc import Sequence

from deltaserve.core.calibration import CalibrationConfig, CalibrationProbe, HostLimits
from deltaserve.core.calibration_loop import ProbeTiming, run_calibration
from deltaserve.core.latency_model import LatencyModel, LatencyModelConfig
from deltaserve.core.shape import ExecMode, StepShape
from deltaserve.hosts.sim.hardware import SimHardware
from deltaserve.hosts.sim.oracle import PrefillChunk, SimBatch, StepNoise


def graph_mode(hw: SimHardware, shape: StepShape) -> ExecMode:
    """The mode a step of ``shape`` (base-model rows) runs in on ``hw``."""
    graph = (hw.graphs and shape.is_decode_only
             and shape.num_decode <= hw.params.max_graph_batch)
    return ExecMode.GRAPH if graph else ExecMode.EAGER


def probe_batch(hw: SimHardware, probe: CalibrationProbe, mode: ExecMode) -> SimBatch:
    """The step a real host would build for ``probe``: decodes each holding
    ``kv_per_decode`` cached tokens, prefill chunks behind ``prefix_len`` cached ones."""
    s = probe.shape
    return SimBatch(
        prefills=tuple(PrefillChunk(n, probe.prefix_len) for n in s.prefill_lens),
        decode_context_lens=(probe.kv_per_decode + 1,) * s.num_decode,
        ft_lens=s.ft_lens, mode=mode, tp=hw.tp)


class SimProber:
    """Times each probe with the oracle, each repeat scaled by the run-to-run noise drawn
    from ``seed``."""

    def __init__(self, hw: SimHardware, limits: HostLimits, *, seed: int = 0):
        self.hw, self._limits = hw, limits
        self.noise = StepNoise(hw.noise_sigma, seed)

    @property
    def limits(self) -> HostLimits:
        return self._limits

    def open(self, plan: Sequence[CalibrationProbe]) -> None:
        """Nothing to set up: the oracle holds no state."""

    def time(self, probe: CalibrationProbe) -> Sequence[ProbeTiming]:
        # as on a graph host: a decode-only probe runs replayed and eager (adapter rows)
        modes = [graph_mode(self.hw, probe.shape)]
        if modes[0] is ExecMode.GRAPH:
            modes.append(ExecMode.EAGER)
        timings = []
        for mode in modes:
            batch = probe_batch(self.hw, probe, mode)
            times = tuple(self.hw.oracle.step_seconds(batch) * self.noise.factor()
                          for _ in range(probe.repeats))
            shape = probe.shape if mode is ExecMode.EAGER else StepShape(
                probe.shape.prefill_lens, probe.shape.num_decode, probe.shape.kv_tokens,
                mode=mode)
            timings.append(ProbeTiming(shape, times))
        return timings

    def close(self) -> None:
        """Nothing to release."""


def calibrate(hw: SimHardware, limits: HostLimits, config: CalibrationConfig | None = None,
              latency: LatencyModelConfig | None = None, *, seed: int = 0) -> LatencyModel:
    """The shared loop with :class:`SimProber`: the simulated engine and the benches call this
    one name."""
    return run_calibration(SimProber(hw, limits, seed=seed), config, latency, progress=False)
