"""The simulator against reality on this machine (issue #13, item 5): the CPU bench's trace,
data, SLO and systems replayed on the simulated host whose oracle is the embedded engine's own
measured steps and backward (:mod:`deltaserve.hosts.sim.measured`), compared with a real CPU
bench run of the same trace and seed, system by system.

    python -m deltaserve.bench.sim.validate --profile cpu_profile.json \\
        --real results/<cpu run>/results.json --out results/<date>-sim-validation

Everything the real run chose is read from its ``results.json``: the trace is rebuilt from the
same generator, seed and length scale at the rate factor its auto-scaling picked; the SLO is the
one its pilot derived; each system's hardware share is the one it recorded (the pilot's host on
every thread; split-pool's, and co-serving hosts on partitioned cores, on all but the trainer's
threads), priced by the profile measured on that many threads. The simulated backward runs on
its own cores (``partition``), so a real run whose co-serving systems shared the host's cores
(``--backward-grant-policy exclusive``, the CPU bench's default) is refused.
Nothing here is fitted to the real run: it is only read to be compared with.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from deltaserve.bench.config import BenchConfig
from deltaserve.bench.outcome import HardwareShare
from deltaserve.bench.prepare import build_trace, calibration_config, host_limits, load_data
from deltaserve.bench.sim.compare import comparison_doc, comparison_markdown
from deltaserve.bench.sim.config import SimBenchConfig
from deltaserve.bench.sim.inputs import SimData
from deltaserve.bench.sim.run import SimSetup, run_system, scored_json
from deltaserve.bench.sim.score import SimOutcome
from deltaserve.bench.systems import parse_systems
from deltaserve.core.config_io import from_dict
from deltaserve.core.errors import InputError
from deltaserve.core.slo import SLOConfig
from deltaserve.hosts.sim.calibrate import calibrate
from deltaserve.hosts.sim.catalogue import ModelShape
from deltaserve.hosts.sim.config import SimHostConfig
from deltaserve.hosts.sim.engine import SimEngine
from deltaserve.hosts.sim.hardware import SimHardware
from deltaserve.hosts.sim.measured import (
    MeasuredBackward,
    MeasuredOracle,
    ThreadProfile,
    load_profile,
)
from deltaserve.hosts.sim.modelled import ModelledParams
from deltaserve.model.loading import load_tokenizer, read_config, resolve_model
from deltaserve.train.config import GrantPolicy
from deltaserve.workloads.trace import Trace


def real_config(doc: dict) -> BenchConfig:
    """The real run's configuration, its auto-scaled rate fixed to the factor it picked."""
    cfg = from_dict(BenchConfig, doc["config"])
    return replace(cfg, rate_scale=doc["trace"]["rate_factor"], progress=False)


def model_shape(cfg: BenchConfig) -> ModelShape:
    mc = read_config(resolve_model(cfg.engine.model))
    return ModelShape(mc.num_layers, mc.hidden_size, mc.intermediate_size, mc.vocab_size,
                      mc.num_heads, mc.num_kv_heads, mc.max_position_embeddings)


def cpu_hardware(host: ThreadProfile, trainer: ThreadProfile, shape: ModelShape,
                 cfg: BenchConfig) -> SimHardware:
    """The host priced by the steps measured on ``host.threads`` threads; the backward and the
    standalone trainer by what was measured on ``trainer.threads`` (their own cores)."""
    oracle = MeasuredOracle(host.steps, shape.num_layers)
    return SimHardware(
        name=f"cpu/{cfg.engine.model} host {host.threads} thread(s), training "
             f"{trainer.threads} (measured)",
        oracle=oracle, backward=MeasuredBackward(trainer.backward, shape.num_layers),
        shape=shape, tp=1, kv_tokens=cfg.engine.kv_cache_tokens,
        policy=GrantPolicy.PARTITION, graphs=False, noise_sigma=oracle.sigma,
        params=ModelledParams(), standalone_tokens_per_s=trainer.standalone_tokens_per_s)


def sim_config(cfg: BenchConfig, slo: SLOConfig) -> SimBenchConfig:
    """The CPU bench's engine, LoRA, optimizer and backward on the simulated host (the backward
    partitioned onto its own cores, as the CPU bench runs it)."""
    e = cfg.engine
    engine = SimHostConfig(model=e.model, max_num_seqs=e.max_num_seqs,
                           max_num_batched_tokens=e.max_num_batched_tokens,
                           max_model_len=e.max_model_len, kv_cache_tokens=e.kv_cache_tokens,
                           gpu="cpu", seed=cfg.seed)
    return SimBenchConfig(
        trace=cfg.trace, systems=cfg.systems, ttft_slo_ms=slo.ttft_s * 1e3,
        tpot_slo_ms=slo.tpot_s * 1e3, seed=cfg.seed, engine=engine, lora=cfg.lora,
        optimizer=cfg.optimizer,
        backward=replace(cfg.backward, grant_policy=GrantPolicy.PARTITION),
        max_sample_tokens=e.max_num_batched_tokens, drain_s=cfg.drain_s, ablation=False,
        progress=False)


@dataclass(frozen=True)
class Inputs:
    """What every simulated system of the validation shares."""

    cfg: BenchConfig
    threads: int
    trace: Trace
    data: SimData
    slo: SLOConfig
    profiles: dict[int, ThreadProfile]
    shape: ModelShape
    shares: dict[str, HardwareShare]


def inputs(real: dict, profile_path: str, work: Path) -> Inputs:
    shares = recorded_shares(real)  # before any model loads
    cfg = real_config(real)
    model_path = resolve_model(cfg.engine.model)
    trace = build_trace(cfg, None, host_limits(cfg, model_path)).trace  # type: ignore[arg-type]
    bench_data = load_data(cfg, work, load_tokenizer(model_path))
    data = SimData(bench_data.path, bench_data.samples, bench_data.report)
    slo = SLOConfig(real["slo"]["ttft_ms"] / 1e3, real["slo"]["tpot_ms"] / 1e3)
    return Inputs(cfg, real["machine"]["threads"], trace, data, slo,
                  load_profile(profile_path), model_shape(cfg), shares)


def recorded_shares(real: dict) -> dict[str, HardwareShare]:
    """Each system's hardware share as the real run recorded it; every co-serving system's
    backward must have had its own cores, as the simulated one does."""
    shares = {}
    for spec in parse_systems(real["config"]["systems"]):
        share = HardwareShare(**real["systems"][spec.name]["hardware_share"])
        if spec.coserve and not share.reserved:
            raise InputError("real", spec.name, "its backward shared the host's cores; the "
                             "validation simulates it on cores of its own: compare with a run "
                             "made with --backward-grant-policy partition")
        shares[spec.name] = share
    return shares


def setup_for(ins: Inputs, host_threads: int, trainer_threads: int) -> SimSetup:
    hw = cpu_hardware(ins.profiles[host_threads], ins.profiles[trainer_threads], ins.shape,
                      ins.cfg)
    cfg = sim_config(ins.cfg, ins.slo)
    limits = SimEngine(cfg.engine, hardware=hw).limits
    latency = calibrate(hw, limits, calibration_config(ins.cfg), seed=ins.cfg.seed)
    return SimSetup(cfg, hw, None, ins.data, latency, limits, ins.slo)


def simulate(ins: Inputs, echo=print) -> tuple[dict[str, SimOutcome], dict[int, SimSetup]]:
    """Every system of the real run, each on its CPU bench hardware share."""
    setups: dict[tuple[int, int], SimSetup] = {}
    outcomes = {}
    for spec in parse_systems(ins.cfg.systems):
        share = ins.shares[spec.name]
        trainer = share.reserved or ins.cfg.backward.threads or 1
        key = (share.host, trainer)
        if key not in setups:
            setups[key] = setup_for(ins, *key)
        t0 = time.perf_counter()
        # one replica serves, as the real host did; a standalone trainer's come beside it
        o = outcomes[spec.name] = run_system(setups[key], spec, 1 + spec.trainer_replicas,
                                             ins.trace)
        echo(f"{spec.name}: host {share.host} thread(s): {o.fleet.end_s:.0f} simulated s in "
             f"{time.perf_counter() - t0:.1f} s")
    return outcomes, {k[0]: s for k, s in setups.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="cpu_profile.py's output")
    ap.add_argument("--real", required=True, help="a real CPU bench run's results.json")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    (work / ".gitignore").write_text("*\n")
    real = json.loads(Path(args.real).read_text())
    ins = inputs(real, args.profile, work)
    print(f"trace {ins.trace.name}: {len(ins.trace)} requests (real run: "
          f"{real['trace']['requests']}); SLO {ins.slo}", flush=True)
    outcomes, setups = simulate(ins)
    any_setup = next(iter(setups.values()))
    simulated = scored_json(any_setup, outcomes, 0.0)
    doc = comparison_doc(real, args.real, args.profile, simulated,
                         {t: s.hw for t, s in setups.items()}, len(ins.trace))
    (out / "validation.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (out / "validation.md").write_text(comparison_markdown(doc))
    print(comparison_markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
