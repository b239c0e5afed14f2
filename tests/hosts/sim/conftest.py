"""Fixtures: the Vidur profiles, loaded once per session from the shared data (skipped cleanly
where the data is absent, through the ``shared_data`` fixture)."""

from __future__ import annotations

import csv
import random
from pathlib import Path

import numpy as np
import pytest

from deltaserve.core.data import TrainingSample
from deltaserve.hosts.sim.catalogue import lookup_profile
from deltaserve.hosts.sim.config import SimHostConfig
from deltaserve.hosts.sim.hardware import SimHardware, gpu_hardware
from deltaserve.hosts.sim.oracle import ProfileOracle
from deltaserve.hosts.sim.profiles import GpuProfiles, load_profiles
from deltaserve.model.lora import LoRAConfig

COMPUTE = Path("compute/a100/meta-llama/Meta-Llama-3-8B")


@pytest.fixture(scope="session")
def vidur_dir(shared_data: Path) -> Path:
    path = shared_data / "vidur"
    if not path.is_dir():
        pytest.skip(f"Vidur profiles not found at {path}")
    return path


@pytest.fixture(scope="session")
def profiles(vidur_dir: Path) -> GpuProfiles:
    return load_profiles(lookup_profile("a100", "llama-3-8b"), vidur_dir)


@pytest.fixture(scope="session")
def oracle(profiles: GpuProfiles) -> ProfileOracle:
    return ProfileOracle(profiles)


def read_rows(path: Path) -> list[dict[str, str]]:
    """The CSV as dicts, read independently of the code under test."""
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def column(rows: list[dict[str, str]], name: str) -> np.ndarray:
    return np.array([float(r[name]) for r in rows])


@pytest.fixture(scope="session")
def hardware(profiles: GpuProfiles) -> SimHardware:
    """The simulated A100 running Llama-3-8B at TP1 (the paper's replica)."""
    return gpu_hardware(SimHostConfig(), LoRAConfig(), profiles=profiles)


def samples(n: int, seed: int = 0, low: int = 40, high: int = 300) -> list[TrainingSample]:
    """``n`` tokenized samples of random lengths (token ids are never read by a simulation;
    every token counts for the loss)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = tuple([1] * rng.randint(low, high))
        out.append(TrainingSample(i, ids, ids))
    return out
