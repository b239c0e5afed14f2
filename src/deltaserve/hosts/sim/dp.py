"""Training across data-parallel replicas: one adapter, synchronous data parallelism.

Every replica holds a copy of the one adapter and its optimizer state. Replicas claim samples from
one shared pool (each sample is trained once across them), capture them in their own steps and
run the backward of their own batch (``batch_tokens`` each) on their own GPU. An optimizer step
needs every replica's gradient: a replica whose local backward is done waits at the barrier; when
the last one arrives, the gradients are all-reduced across the replicas (time from the network
profile) and every replica applies the same AdamW step to its copy, so the copies stay equal.
The global batch is ``replicas × batch_tokens``.

Why synchronous: it is what a user expects of "N GPUs train one adapter" (DDP semantics: the
result does not depend on which replica a sample landed on), and every sample's activations are
captured with the adapter its gradient is applied to, as on one GPU. Its cost is the barrier: a
replica busy with a burst holds the others' optimizer step back. The simulation counts that wait
(:attr:`GradientSync.wait_s`) so the report can say what it cost.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from deltaserve.core.errors import require
from deltaserve.hosts.sim.catalogue import ModelShape
from deltaserve.hosts.sim.modelled import AdapterShape
from deltaserve.hosts.sim.profiles import GpuProfiles

# LoRA gradients are reduced in fp32 (the adapter's master precision): 2 fp16 elements each
FP32_IN_FP16_ELEMENTS = 2

Release = Callable[[float], None]  # a member's callback: its job completes at that time
EmptyHanded = Callable[[], bool]


@dataclass
class GradientSync:
    """The barrier and all-reduce of one data-parallel group of ``size`` replicas.
    ``allreduce_s``: one all-reduce of the adapter's gradient across them.

    A replica with nothing to contribute (no sample captured, in flight or obtainable: the
    pool has none left until the epoch's other samples are committed) joins an open round with
    a zero gradient, as PyTorch DDP's ``Join`` does for uneven inputs; otherwise the end of
    every epoch would wait forever for it."""

    size: int
    allreduce_s: float
    wait_s: float = 0.0  # replica-seconds spent waiting at the barrier
    rounds: int = 0
    _arrived: dict[int, tuple[float, Release, float]] = field(default_factory=dict)
    _empty_handed: dict[int, EmptyHanded] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(self.size >= 1, "replicas", self.size, "must be >= 1")
        require(self.allreduce_s >= 0, "allreduce_s", self.allreduce_s, "must be >= 0")

    def member(self, rank: int, empty_handed: EmptyHanded) -> None:
        """Replica ``rank`` trains in this group; ``empty_handed`` says it has nothing to add."""
        self._empty_handed[rank] = empty_handed

    def arrive(self, rank: int, now_s: float, optimizer_s: float, release: Release) -> None:
        """Replica ``rank``'s local backward is done at ``now_s``; ``release`` is called with
        the time its job completes (after the all-reduce and its optimizer step) once the
        round closes."""
        assert rank not in self._arrived, f"replica {rank} arrived twice in one round"
        self._arrived[rank] = (now_s, release, optimizer_s)
        self.poll(now_s)

    def poll(self, now_s: float) -> None:
        """Close the open round if every member has arrived or has nothing to add."""
        if not self._arrived:
            return
        for rank in range(self.size):
            if rank not in self._arrived and not self._empty_handed.get(rank, _never)():
                return
        reduce_s = self.allreduce_s if self.size > 1 else 0.0
        members, self._arrived = self._arrived, {}
        self.rounds += 1
        for t, done, optimizer_s in members.values():
            self.wait_s += now_s - t
            done(now_s + reduce_s + optimizer_s)


def _never() -> bool:
    return False


def allreduce_seconds(profiles: GpuProfiles | None, replicas: int, tp: int, shape: ModelShape,
                      lora: AdapterShape) -> float:
    """One all-reduce of the adapter's gradient across ``replicas`` (each TP rank reduces its
    1/``tp`` share with its peers). From the network profile's rows for that many GPUs on one
    node; 3 replicas use the 4-GPU rows (an upper bound) and a group larger than the profiled
    node uses them too (unprofiled: cross-node links are slower)."""
    if replicas <= 1 or profiles is None:
        return 0.0
    elems = lora.num_params(shape) * FP32_IN_FP16_ELEMENTS / tp
    workers = 2 if replicas == 2 else 4
    curve = profiles.tp(workers).all_reduce_elems
    assert curve is not None
    return curve(elems) * 1e-3
