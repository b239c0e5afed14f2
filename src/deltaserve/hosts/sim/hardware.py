"""What a simulated host runs on: a step-time oracle, the backward's cost model, the KV capacity
and how the backward shares the device. Built once per experiment and shared by its replicas
(loading and fitting the profiles takes seconds; a replica is cheap)."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.core.errors import require
from deltaserve.hosts.sim.backward import BackwardCost, BackwardModel
from deltaserve.hosts.sim.catalogue import (
    PROBE_SOURCE,
    ModelShape,
    ProfileEntry,
    lookup_profile,
    resolve_shared,
)
from deltaserve.hosts.sim.config import MemoryBudget, SimHostConfig, memory_budget
from deltaserve.hosts.sim.h200 import H200Oracle, load_probe
from deltaserve.hosts.sim.modelled import AdapterShape, ModelledParams
from deltaserve.hosts.sim.oracle import ProfileOracle, StepTimeOracle
from deltaserve.hosts.sim.profiles import GpuProfiles, load_profiles
from deltaserve.model.lora import LoRAConfig
from deltaserve.train.config import GrantPolicy


@dataclass(frozen=True)
class SimHardware:
    """``graphs``: decode-only steps of base-model requests replay CUDA graphs (up to
    ``params.max_graph_batch`` rows). ``policy``: how the backward shares the device
    (``prefill`` on a GPU, ``partition`` for a CPU with the backward on its own cores).
    ``noise_sigma``: run-to-run spread of a step (log-space σ). ``memory``: how the KV capacity
    was derived (None where it was given). ``standalone_tokens_per_s``: a measured standalone
    trainer's rate (split-pool's), where one was measured; else the oracle's forward and the
    backward cost price it."""

    name: str
    oracle: StepTimeOracle
    backward: BackwardCost
    shape: ModelShape
    tp: int
    kv_tokens: int
    policy: GrantPolicy
    graphs: bool
    noise_sigma: float
    params: ModelledParams
    memory: MemoryBudget | None = None
    standalone_tokens_per_s: float | None = None


def adapter_shape(lora: LoRAConfig) -> AdapterShape:
    """The oracle's view of the trained adapter: its rank and attention targets (the oracle
    prices LoRA on q/k/v/o projections; the MLP ones are refused there)."""
    return AdapterShape(r=lora.r, target_modules=tuple(lora.target_modules))


def gpu_hardware(config: SimHostConfig, lora: LoRAConfig, params: ModelledParams | None = None,
                 profiles: GpuProfiles | None = None) -> SimHardware:
    """A simulated GPU of the catalogue (Vidur profiles loaded unless given; an entry of
    measured whole steps is fitted from its file)."""
    entry: ProfileEntry = lookup_profile(config.gpu, config.model)
    params = params or ModelledParams()
    if entry.source == PROBE_SOURCE:
        return probe_hardware(entry, config, lora, params)
    if profiles is None:
        profiles = load_profiles(entry, config.vidur_dir, config.network)
    adapter = adapter_shape(lora)
    oracle = ProfileOracle(profiles, params, adapter)
    profiles.tp(config.tp)  # refuses a degree the profiles lack
    # the buffer holds one backward batch and the longest sample, which fits one step
    memory = memory_budget(entry, config.tp, config.gpu_memory_utilization,
                           256 + config.max_num_batched_tokens, adapter.num_params(entry.shape))
    return SimHardware(
        name=f"{entry.gpu}/{entry.model} TP{config.tp} ({profiles.network})", oracle=oracle,
        backward=BackwardModel(oracle, entry.shape, params, adapter), shape=entry.shape,
        tp=config.tp, kv_tokens=memory.kv_tokens, policy=GrantPolicy.PREFILL, graphs=True,
        noise_sigma=oracle.noise_sigma(config.tp) if config.noise else 0.0, params=params,
        memory=memory)


def probe_hardware(entry: ProfileEntry, config: SimHostConfig, lora: LoRAConfig,
                   params: ModelledParams) -> SimHardware:
    """The H200 of measured steps (``h200.py``): its oracle fitted to them, the backward priced
    from its forward by ``params`` as on the A100. ``config.vidur_dir`` does not apply."""
    require(config.tp in entry.tp_degrees, "tp", config.tp,
            f"{entry.gpu}/{entry.model} was measured at TP {entry.tp_degrees} only")
    oracle = H200Oracle(load_probe(resolve_shared(entry.compute_subdir, "h200_probe")),
                        entry.shape.num_layers)
    adapter = adapter_shape(lora)
    memory = memory_budget(entry, config.tp, config.gpu_memory_utilization,
                           256 + config.max_num_batched_tokens, adapter.num_params(entry.shape))
    return SimHardware(
        name=f"{entry.gpu}/{entry.model} TP{config.tp} (measured steps)", oracle=oracle,
        backward=BackwardModel(oracle, entry.shape, params, adapter), shape=entry.shape,
        tp=config.tp, kv_tokens=memory.kv_tokens, policy=GrantPolicy.PREFILL, graphs=True,
        noise_sigma=oracle.noise_sigma(config.tp) if config.noise else 0.0, params=params,
        memory=memory)
