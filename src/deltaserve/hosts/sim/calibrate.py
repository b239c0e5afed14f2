"""Calibration on a simulated host: the same plan a real host runs (:func:`deltaserve.core.
calibration.build_plan`), each probe timed by the oracle with its run-to-run noise, the median of
its repeats fitted by the same latency model. Its error against the oracle is therefore measured
(``LatencyModel.quality``, and online during a run), not assumed. No warm-up run: a simulated
step has no caches to warm."""

from __future__ import annotations

import statistics

from deltaserve.core.calibration import CalibrationConfig, CalibrationProbe, HostLimits, build_plan
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


def calibrate(hw: SimHardware, limits: HostLimits, config: CalibrationConfig | None = None,
              latency: LatencyModelConfig | None = None, *, seed: int = 0) -> LatencyModel:
    noise = StepNoise(hw.noise_sigma, seed)
    model = LatencyModel(latency)
    for probe in build_plan(limits, config):
        # as on a graph host: a decode-only probe runs replayed and eager (adapter rows)
        modes = [graph_mode(hw, probe.shape)]
        if modes[0] is ExecMode.GRAPH:
            modes.append(ExecMode.EAGER)
        for mode in modes:
            batch = probe_batch(hw, probe, mode)
            times = [hw.oracle.step_seconds(batch) * noise.factor()
                     for _ in range(probe.repeats)]
            shape = probe.shape if mode is ExecMode.EAGER else StepShape(
                probe.shape.prefill_lens, probe.shape.num_decode, probe.shape.kv_tokens,
                mode=mode)
            model.add_calibration(shape, statistics.median(times))
    model.fit()
    return model
