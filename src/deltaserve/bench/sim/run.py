"""The parts of a simulated experiment: its shared setup (profiles, oracle, data, the latency
model calibrated through the oracle once: every replica of every system starts from a copy and
refits online), one system's replay on a fresh fleet, and their scores."""

from __future__ import annotations

from dataclasses import dataclass, replace

from deltaserve.bench.coserve_config import BenchTraining, coserve_config, system_grant
from deltaserve.bench.outcome import Commit
from deltaserve.bench.score import HarvestBase
from deltaserve.bench.sim.config import SimBenchConfig
from deltaserve.bench.sim.inputs import SimData, sim_samples
from deltaserve.bench.sim.paper import ablation_table
from deltaserve.bench.sim.score import (
    SimOutcome,
    SimScore,
    hardware_share,
    harvest_base,
    score,
    system_run,
)
from deltaserve.bench.sim.systems import sim_systems
from deltaserve.bench.systems import PILOT, SystemSpec
from deltaserve.core.calibration import CalibrationConfig, HostLimits
from deltaserve.core.errors import require
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.slo import SLOConfig
from deltaserve.hosts.sim import standalone
from deltaserve.hosts.sim.backward import BackwardModel
from deltaserve.hosts.sim.calibrate import calibrate
from deltaserve.hosts.sim.catalogue import VIDUR_SOURCE, lookup_profile
from deltaserve.hosts.sim.dp import allreduce_seconds
from deltaserve.hosts.sim.engine import SimEngine
from deltaserve.hosts.sim.fleet import CoServing, Fleet
from deltaserve.hosts.sim.hardware import SimHardware, gpu_hardware
from deltaserve.hosts.sim.modelled import ModelledParams
from deltaserve.hosts.sim.profiles import GpuProfiles, load_profiles
from deltaserve.train.config import GrantPolicy
from deltaserve.workloads.trace import Trace

ABLATION_SYSTEMS = "inference-only,deltaserve,deltaserve-temp,deltaserve-no-interrupt"
# the region a GPU trace reaches: long contexts and large decode batches
GPU_CALIBRATION = CalibrationConfig(decode_batches=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                                    decode_kv_lens=(64, 256, 1024, 4096),
                                    chunk_prefixes=(64, 256, 640, 2048))


def log(cfg: SimBenchConfig, msg: str) -> None:
    if cfg.progress:
        print(f"[sim-bench] {msg}", flush=True)


@dataclass(frozen=True)
class SimSetup:
    """What every system of one experiment shares."""

    cfg: SimBenchConfig
    hw: SimHardware
    profiles: GpuProfiles | None  # None: a host not priced by GPU profiles (no all-reduce)
    data: SimData
    latency: LatencyModel
    limits: HostLimits
    slo: SLOConfig

    def allreduce_s(self, replicas: int) -> float:
        model = self.hw.backward
        if replicas <= 1 or not isinstance(model, BackwardModel):
            return 0.0
        # a GPU priced by measured whole steps (the H200) has no network profile to price it
        require(self.profiles is not None, "replicas", replicas,
                f"{self.hw.name} has no network profile for a data-parallel all-reduce")
        return allreduce_seconds(self.profiles, replicas, self.hw.tp, self.hw.shape, model.lora)


def prepare(cfg: SimBenchConfig, params: ModelledParams | None = None,
            profiles: GpuProfiles | None = None, data: SimData | None = None) -> SimSetup:
    """Profiles, oracle, data and the calibrated latency model (reused when given)."""
    e = cfg.engine
    entry = lookup_profile(e.gpu, e.model)
    if entry.source != VIDUR_SOURCE:  # measured whole steps: one GPU, no network profile
        require(cfg.replicas == 1, "replicas", cfg.replicas,
                f"{e.gpu}/{e.model} has no network profile for a data-parallel all-reduce: "
                "simulate one replica")
    elif profiles is None:
        profiles = load_profiles(entry, e.vidur_dir, e.network)
    hw = gpu_hardware(replace(e, seed=cfg.seed), cfg.lora, params, profiles)
    limits = SimEngine(e, hardware=hw).limits
    latency = calibrate(hw, limits, GPU_CALIBRATION, seed=cfg.seed)
    return SimSetup(cfg, hw, profiles, data or sim_samples(cfg), latency, limits,
                    SLOConfig(cfg.ttft_slo_ms / 1e3, cfg.tpot_slo_ms / 1e3))


def grant_policy(setup: SimSetup, spec: SystemSpec) -> GrantPolicy:
    """How a system's backward shares the simulated GPU: the bench's ``--backward-grant-policy``
    where given, else the system's own (``llmstation-exclusive``: LLMStation's time-sliced
    tasklets, ``exclusive``: the host lends the device before a step for what
    ``LLMStationScheduler.yield_budget_s`` prices, and in idle time), else the host's
    (``prefill``: DeltaServe's separate backward process that overlaps decode steps and parks
    at a layer boundary for prefills). Every system but ``llmstation-exclusive`` runs under the
    same grant, so each reported pair differs in one thing."""
    return system_grant(spec, setup.cfg.backward.grant_policy, setup.hw.policy)


def bench_training(setup: SimSetup) -> BenchTraining:
    """What the simulated bench gives every co-serving system, as the CPU bench does (the
    simulated trainer writes no checkpoint; there is no bench-wide ``--pipeline``)."""
    cfg = setup.cfg
    return BenchTraining(slo=setup.slo, lora=cfg.lora, optimizer=cfg.optimizer,
                         backward=cfg.backward, max_step_tokens=cfg.engine.max_num_batched_tokens,
                         seed=cfg.seed, host_grant=setup.hw.policy)


def run_system(setup: SimSetup, spec: SystemSpec, replicas: int, trace: Trace,
               repeat: int = 0) -> SimOutcome:
    """``spec`` on ``replicas`` GPU groups of TP ``tp`` (split-pool: one of them trains), run
    until its requests finished and the scoring window closed (its training goes on to the
    window's end however early its requests drained; later commits are not counted).
    ``repeat``: its index among the system's repeats, added to the seed of the step noise."""
    cfg, hw = setup.cfg, setup.hw
    seed = cfg.seed + repeat
    window_s = cfg.window_s(trace.duration_s)
    serving = replicas - spec.trainer_replicas
    fleet = Fleet(hw, replace(cfg.engine, seed=seed), serving, cfg.router, seed=seed)
    if spec.coserve:
        fleet.coserve(CoServing(coserve_config(spec, bench_training(setup)), setup.latency,
                                setup.data.samples, spec.scheduler_cls,
                                setup.allreduce_s(replicas)))
    run = fleet.replay(trace, min_end_s=window_s)
    # every replica commits its own share of a global step: its tokens and samples (packed)
    commits = [Commit(c.at_s, c.num_tokens, len(c.sample_ids), c.num_tokens)
               for c in run.commits]
    if spec.trainer_replicas:  # split-pool: the standalone trainer on its reserved replica
        commits = [Commit(s.at_s, s.num_tokens, s.num_samples, s.num_tokens)
                   for s in standalone.train(hw, setup.data.samples, cfg.backward.batch_tokens,
                                             run.end_s, seed=seed)]
    fleet.close()
    share = hardware_share(spec, replicas, hw.tp)
    return SimOutcome(system_run(spec, run, commits, share), run, hw.tp, window_s)


def run_systems(setup: SimSetup, specs: tuple[SystemSpec, ...], replicas: int, trace: Trace,
                repeat: int = 0) -> dict[str, SimOutcome]:
    out = {}
    tag = f" #{repeat + 1}" if setup.cfg.repeats > 1 else ""
    for spec in specs:
        if replicas <= spec.trainer_replicas:
            if repeat == 0:
                log(setup.cfg, f"{spec.name}: needs {spec.trainer_replicas + 1} GPU groups or "
                               f"more ({spec.trainer_replicas} to train); skipped")
            continue
        out[spec.name] = o = run_system(setup, spec, replicas, trace, repeat)
        log(setup.cfg, f"{spec.name}{tag}: {o.fleet.end_s:.0f} simulated s in "
                        f"{o.fleet.wall_s:.1f} s wall ({o.fleet.events} events)")
    return out


def base_of(setup: SimSetup, outcomes: dict[str, SimOutcome], standalone_tps: float
            ) -> HarvestBase:
    """The harvest's terms from the pilot among ``outcomes`` (none: ratios stay None), over
    the window they were all replayed for."""
    gpus = max(o.run.share.cores for o in outcomes.values())
    windows = {o.window_s for o in outcomes.values()}
    require(len(windows) == 1, "window_s", sorted(windows),
            "every system of one scoring must be replayed for the same window")
    return harvest_base(outcomes.get(PILOT), standalone_tps, gpus, setup.hw.tp, windows.pop())


def score_all(setup: SimSetup, outcomes: dict[str, SimOutcome], base: HarvestBase
              ) -> dict[str, SimScore]:
    return {name: score(o, setup.slo, base) for name, o in outcomes.items()}


def scored_json(setup: SimSetup, outcomes: dict[str, SimOutcome], standalone_tps: float
                ) -> dict[str, dict]:
    """Every system's score as ``results.json`` holds it."""
    base = base_of(setup, outcomes, standalone_tps)
    return {n: s.as_json() for n, s in score_all(setup, outcomes, base).items()}


def run_ablation(setup: SimSetup, trace: Trace) -> dict:
    """The one-GPU ablations, on the trace thinned to one GPU's share of it."""
    cfg = setup.cfg
    one = trace if cfg.replicas == 1 else trace.scale_rate(1.0 / cfg.replicas, cfg.seed)
    scored = scored_json(setup, run_systems(setup, sim_systems(ABLATION_SYSTEMS), 1, one), 0.0)
    return {"trace": {"requests": len(one), "rate_factor": 1.0 / cfg.replicas},
            "systems": scored, "table": ablation_table(scored)}
