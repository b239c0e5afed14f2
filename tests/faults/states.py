"""Known training states to checkpoint: the state after step ``s`` of run ``r`` is a pure function
of (r, s), so a loaded checkpoint is checked against an independent reference, and a mix of
files written at different moments (adapter of one step, optimizer of another) shows."""

from __future__ import annotations

from pathlib import Path

import torch

from deltaserve.core.pool import SamplePool
from deltaserve.model.config import ModelConfig
from deltaserve.model.lora import AdapterWeights, LoRAConfig
from deltaserve.train.checkpoint_store import Checkpoint, CheckpointStore
from deltaserve.train.optim import OptimizerState
from tests.tiny import TINY

MODEL = ModelConfig.from_hf(TINY)
LORA = LoRAConfig(r=4, alpha=8, dropout=0.0)
NUM_SAMPLES = 200
BASE_MODEL = "tiny-llama"


def adapter_at(step: int, run: int = 0) -> AdapterWeights:
    a = AdapterWeights(MODEL, LORA)
    g = torch.Generator().manual_seed(1_000 * run + step)
    with torch.no_grad():
        a.flat.copy_(torch.randn(a.numel, generator=g))
    return a


def optimizer_at(step: int, run: int = 0) -> OptimizerState:
    o = OptimizerState(adapter_at(0).numel)
    o.exp_avg.fill_(0.5 * step + run)
    o.exp_avg_sq.fill_(0.25 * step + run)
    o.step.fill_(step)
    return o


def pool_at(step: int) -> dict:
    """Progress after ``step`` optimizer steps of one sample each: samples 0..step-1 done."""
    pool = SamplePool([4] * NUM_SAMPLES, num_epochs=1, seed=3)
    pool.claim(range(step))
    pool.commit(range(step))
    return pool.state_dict()


def save_step(store: CheckpointStore, step: int, run: int = 0) -> Path:
    return store.save(step, adapter_at(step, run), optimizer_at(step, run), pool_at(step),
                      BASE_MODEL, f"run-{run}")


def run_of(ck: Checkpoint) -> int:
    return int(ck.trainer_state["dataset_fingerprint"].removeprefix("run-"))


def assert_consistent(ck: Checkpoint, run: int | None = None) -> None:
    """Adapter, optimizer state and trainer_state all hold the state of the same (run, step)."""
    r = run_of(ck)
    assert run is None or r == run, f"{ck.path}: a checkpoint of run {r}, expected run {run}"
    assert ck.path.name == f"checkpoint-{ck.step:06d}"
    assert torch.equal(ck.adapter.flat, adapter_at(ck.step, r).flat), f"{ck.path}: adapter"
    want = optimizer_at(ck.step, r)
    assert torch.equal(ck.optimizer["exp_avg"], want.exp_avg), f"{ck.path}: optimizer"
    assert torch.equal(ck.optimizer["exp_avg_sq"], want.exp_avg_sq), f"{ck.path}: optimizer"
    assert int(ck.optimizer["step"]) == ck.step, f"{ck.path}: optimizer step"
    assert ck.trainer_state["pool"] == pool_at(ck.step), f"{ck.path}: pool progress"
