"""Checkpoints: the adapter in PEFT's format, the optimizer state and the data-loader progress.

Layout under the checkpoint root::

    checkpoint-000050/adapter_config.json        PEFT: loads in peft, transformers, vLLM
    checkpoint-000050/adapter_model.safetensors
    checkpoint-000050/optimizer.pt               AdamW moments and step
    checkpoint-000050/trainer_state.json         step, pool progress, dataset fingerprint
    latest                                       name of the newest complete checkpoint
    train_log.jsonl                              one line per optimizer step

A checkpoint is written into a temporary directory and renamed into place, then ``latest`` is
replaced atomically, so a crash leaves the previous checkpoint intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deltaserve.core.data import TrainingSample
from deltaserve.core.errors import InputError, require
from deltaserve.model.config import ModelConfig
from deltaserve.model.lora import AdapterWeights
from deltaserve.model.peft_io import load_adapter, save_adapter
from deltaserve.train.optim import OptimizerState

FORMAT = "deltaserve.checkpoint/1"


@dataclass(frozen=True)
class CheckpointConfig:
    """``root`` None disables checkpoints. ``every_steps``: optimizer steps between two."""

    root: str | None = None
    every_steps: int = 50
    keep: int = 2
    resume: bool = True

    def __post_init__(self) -> None:
        require(self.every_steps >= 1, "checkpoint_every", self.every_steps, "must be >= 1")
        require(self.keep >= 1, "keep_checkpoints", self.keep, "must be >= 1")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    adapter: AdapterWeights
    optimizer: dict[str, torch.Tensor]
    trainer_state: dict[str, Any]


def dataset_fingerprint(samples: Sequence[TrainingSample]) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(len(s.input_ids).to_bytes(4, "little"))
        h.update(bytes(str(s.input_ids[:8] + s.labels[-8:]), "ascii"))
    return h.hexdigest()[:16]


def write_checkpoint(root: str | os.PathLike, step: int, adapter: AdapterWeights,
                     optimizer: OptimizerState, pool_state: dict, base_model: str,
                     fingerprint: str, keep: int = 2) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"checkpoint-{step:06d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_adapter(tmp, adapter, base_model)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    state = {"format": FORMAT, "step": step, "pool": pool_state, "base_model": base_model,
             "dataset_fingerprint": fingerprint, "written_at": time.time()}
    (tmp / "trainer_state.json").write_text(json.dumps(state))
    if final.exists():  # the same step again (shutdown right after a periodic checkpoint)
        shutil.rmtree(final)
    os.rename(tmp, final)
    pointer = root / "latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / "latest")
    for old in sorted(root.glob("checkpoint-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def find_latest(root: str | os.PathLike) -> Path | None:
    pointer = Path(root) / "latest"
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / "trainer_state.json").is_file() else None


def read_checkpoint(path: str | os.PathLike, model: ModelConfig) -> Checkpoint:
    path = Path(path)
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError("checkpoint", str(path), f"unreadable trainer_state.json: {e}") from e
    require(state.get("format") == FORMAT, "checkpoint", str(path), "not a DeltaServe checkpoint")
    adapter = load_adapter(path, model)
    opt = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    return Checkpoint(path, int(state["step"]), adapter, opt, state)


class TrainingLog:
    """Appends one JSON line per optimizer step."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path) if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
