"""Issue #22 item 3: one SystemSpec → CoServeConfig for both benches. The CPU bench and the
simulated bench, given the same spec and the same engine, LoRA, optimizer, backward, seed and
SLO, configure the same co-server; the pipelined buffer and the grant are checked against their
closed forms."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from deltaserve.bench import execute
from deltaserve.bench.config import BenchConfig
from deltaserve.bench.coserve_config import coserve_config, pipelined_buffer_tokens
from deltaserve.bench.outcome import HardwareShare
from deltaserve.bench.sim import run as sim_run
from deltaserve.bench.sim.config import SimBenchConfig
from deltaserve.bench.sim.systems import sim_systems
from deltaserve.bench.systems import SPECS, SYSTEMS
from deltaserve.core import AdmissionMode, SLOConfig
from deltaserve.hosts.config import HostConfig
from deltaserve.hosts.sim.config import SimHostConfig
from deltaserve.model.lora import LoRAConfig
from deltaserve.train.checkpoint_store import CheckpointConfig
from deltaserve.train.config import BackwardConfig, CoServeConfig, GrantPolicy
from deltaserve.train.optim import OptimizerConfig

SLO = SLOConfig(ttft_s=0.4, tpot_s=0.12)
STEP_TOKENS = 512
LORA = LoRAConfig(r=4, alpha=8)
OPTIMIZER = OptimizerConfig(lr=3e-4)


def cpu_config(spec_name: str, backward: BackwardConfig, **kw) -> CoServeConfig:
    cfg = BenchConfig(engine=HostConfig(max_num_batched_tokens=STEP_TOKENS), lora=LORA,
                      optimizer=OPTIMIZER, backward=backward, seed=7, **kw)
    spec = SPECS[spec_name]
    return coserve_config(spec, execute.bench_training(cfg, SLO, Path("/ckpt")))


def sim_config(spec_name: str, backward: BackwardConfig,
               host_grant: GrantPolicy = GrantPolicy.AUTO) -> CoServeConfig:
    cfg = SimBenchConfig(engine=SimHostConfig(max_num_batched_tokens=STEP_TOKENS), lora=LORA,
                         optimizer=OPTIMIZER, backward=backward, seed=7)
    setup = SimpleNamespace(cfg=cfg, slo=SLO, hw=SimpleNamespace(policy=host_grant))
    (spec,) = sim_systems(spec_name)
    return coserve_config(spec, sim_run.bench_training(setup))


@pytest.mark.parametrize("name", [n for n in SYSTEMS if SPECS[n].coserve])
def test_both_benches_configure_the_same_coserver(name):
    backward = BackwardConfig(batch_tokens=128, grant_policy=GrantPolicy.PARTITION)
    cpu, sim = cpu_config(name, backward), sim_config(name, backward)
    # the CPU bench keeps a checkpoint folder per run; the simulated trainer writes none
    assert cpu.checkpoint == CheckpointConfig(root="/ckpt", every_steps=10**9, resume=False)
    assert replace(cpu, checkpoint=sim.checkpoint) == sim
    spec = SPECS[name]
    assert sim.admission.mode is spec.mode and sim.interrupt is spec.interrupt
    assert sim.admission.admit_during_backward is spec.pipeline
    assert (sim.lora, sim.optimizer, sim.seed, sim.slo) == (LORA, OPTIMIZER, 7, SLO)
    assert sim.num_epochs is None  # trains until the bench stops it
    assert sim.backward.grant_policy is GrantPolicy.PARTITION  # the bench's flag
    # 3 batches and one step when pipelined; else the co-server's default (batch + longest)
    assert sim.backward.buffer_tokens == (3 * 128 + STEP_TOKENS if spec.pipeline else None)


def test_a_pipelined_buffer_is_three_batches_and_a_step_unless_given():
    assert pipelined_buffer_tokens(256, 1024) == 1792
    pipe = cpu_config("deltaserve-pipeline", BackwardConfig(batch_tokens=100))
    assert pipe.backward.buffer_tokens == 300 + STEP_TOKENS
    given = BackwardConfig(batch_tokens=100, buffer_tokens=999)
    assert cpu_config("deltaserve-pipeline", given).backward.buffer_tokens == 999
    assert sim_config("deltaserve-pipeline", given).backward.buffer_tokens == 999
    # the CPU bench's --pipeline pipelines every co-serving system
    flat = cpu_config("deltaserve", BackwardConfig(batch_tokens=100), pipeline=True)
    assert flat.admission.admit_during_backward and flat.backward.buffer_tokens == 812
    assert flat.admission.mode is AdmissionMode.FULL


def test_the_grant_is_the_benchs_flag_then_the_systems_then_the_hosts():
    auto = BackwardConfig()
    # a system that names a grant gets it on either bench; the others get the host's
    exclusive = replace(SPECS["deltaserve"], grant=GrantPolicy.EXCLUSIVE)
    cfg = BenchConfig()
    assert execute.grant_policy(cfg, exclusive) is GrantPolicy.EXCLUSIVE
    assert execute.grant_policy(cfg, SPECS["deltaserve"]) is GrantPolicy.AUTO  # the co-server's
    flag = BenchConfig(backward=BackwardConfig(grant_policy=GrantPolicy.PARTITION))
    assert execute.grant_policy(flag, exclusive) is GrantPolicy.PARTITION
    # on the simulated GPU: its own llmstation-exclusive, the host's prefill for the rest
    assert sim_config("llmstation-exclusive", auto,
                      GrantPolicy.PREFILL).backward.grant_policy is GrantPolicy.EXCLUSIVE
    assert sim_config("llmstation", auto,
                      GrantPolicy.PREFILL).backward.grant_policy is GrantPolicy.PREFILL


def test_a_partitioned_or_split_system_gives_its_trainer_threads_and_no_other_does():
    cfg = BenchConfig(backward=BackwardConfig(threads=2))
    shares = {n: execute.hardware_share(cfg, SPECS[n], 8) for n in ("deltaserve", "split-pool")}
    assert shares["split-pool"] == HardwareShare(8, 6, 2)
    assert shares["deltaserve"] == HardwareShare(8, 8, 0)
    part = replace(cfg, backward=BackwardConfig(threads=2, grant_policy=GrantPolicy.PARTITION))
    assert execute.hardware_share(part, SPECS["deltaserve"], 8) == HardwareShare(8, 6, 2)
    assert execute.hardware_share(part, SPECS["inference-only"], 8) == HardwareShare(8, 8, 0)
