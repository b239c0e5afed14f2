"""A simulated host's step in flight, and the oracle's view of a scheduled batch."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.core.contract import CoServingHooks, TrainingStep
from deltaserve.core.shape import ExecMode, StepShape
from deltaserve.hosts.native.scheduler import ScheduledBatch
from deltaserve.hosts.sim.oracle import PrefillChunk, SimBatch


@dataclass(eq=False)
class RunningStep:
    """A step in flight; ``co``: the co-server that planned it (it observes it, even when it
    was detached meanwhile)."""

    batch: ScheduledBatch
    co: CoServingHooks | None
    step: TrainingStep | None
    shape: StepShape
    start_s: float
    seconds: float
    num_layers: int

    @property
    def layer_s(self) -> float:
        return self.seconds / self.num_layers


@dataclass(eq=False)
class YieldingStep:
    """A scheduled batch waiting while the host lends the device to the backward."""

    batch: ScheduledBatch
    mode: ExecMode


def sim_batch(batch: ScheduledBatch, ft_lens: tuple[int, ...], mode: ExecMode, tp: int
              ) -> SimBatch:
    """The oracle's batch: each chunk behind its cached prefix, each decode over its context."""
    prefills, decodes = [], []
    for item in batch.items:
        if item.is_decode:
            decodes.append(item.request.num_computed + 1)
        else:
            prefills.append(PrefillChunk(item.num_tokens, item.request.num_computed))
    return SimBatch(tuple(prefills), tuple(decodes), ft_lens, mode=mode, tp=tp)
