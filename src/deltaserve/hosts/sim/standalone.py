"""A standalone trainer on its own simulated GPU (split-pool's training half, and the rate a
harvest is measured against): batches of whole samples until ``batch_tokens``, each a packed
forward of its samples and the backward of :class:`~deltaserve.hosts.sim.backward.BackwardModel`
(recompute, backward, loss, AdamW) back to back, with the oracle's noise. No grant, no
contention, no capture buffer to wait for: the device is its own."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from deltaserve.core.data import TrainingSample
from deltaserve.hosts.sim.backward import BackwardJob
from deltaserve.hosts.sim.hardware import SimHardware
from deltaserve.hosts.sim.oracle import SimBatch, StepNoise


@dataclass(frozen=True)
class StandaloneStep:
    """One optimizer step of the standalone trainer: when it landed (simulated s), its
    tokens and samples."""

    at_s: float
    num_tokens: int
    num_samples: int


def batches(samples: Sequence[TrainingSample], batch_tokens: int, seed: int
            ) -> Iterator[tuple[int, ...]]:
    """Sample lengths in batches of whole samples reaching ``batch_tokens``, epoch after epoch
    in a seeded shuffle."""
    epoch = 0
    while True:
        order = list(range(len(samples)))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        batch: list[int] = []
        for i in order:
            batch.append(samples[i].num_tokens)
            if sum(batch) >= batch_tokens:
                yield tuple(batch)
                batch = []
        epoch += 1


def step_seconds(hw: SimHardware, lens: tuple[int, ...]) -> float:
    """A packed forward of ``lens`` and its backward, with the device to itself (at the
    measured standalone rate where one was measured)."""
    if hw.standalone_tokens_per_s:
        return sum(lens) / hw.standalone_tokens_per_s
    forward = hw.oracle.step_seconds(SimBatch(ft_lens=lens, tp=hw.tp))
    return forward + hw.backward.seconds(BackwardJob(lens, hw.tp))


def train(hw: SimHardware, samples: Sequence[TrainingSample], batch_tokens: int, until_s: float,
          *, seed: int = 0) -> list[StandaloneStep]:
    """Every step that lands by ``until_s``."""
    noise = StepNoise(hw.noise_sigma, seed)
    steps, t = [], 0.0
    for lens in batches(samples, batch_tokens, seed):
        t += step_seconds(hw, lens) * noise.factor()
        if t > until_s:
            return steps
        steps.append(StandaloneStep(t, sum(lens), len(lens)))
    return steps


def tokens_per_s(hw: SimHardware, samples: Sequence[TrainingSample], batch_tokens: int,
                 *, seed: int = 0) -> float:
    """Median-time throughput over one epoch's batches (no noise)."""
    tokens = seconds = 0.0
    gen = batches(samples, batch_tokens, seed)
    for _ in range(max(1, sum(s.num_tokens for s in samples) // batch_tokens)):
        lens = next(gen)
        tokens += sum(lens)
        seconds += step_seconds(hw, lens)
    return tokens / seconds
