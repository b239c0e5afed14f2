"""Which samples a data-parallel replica trains in each epoch.

Every epoch, the dataset's ids are put in one seeded order, the same on every replica (it
depends only on the seed, the epoch and the dataset size), and replica ``rank`` of
``world_size`` takes every ``world_size``-th id from position ``rank``. The shards of an epoch
are therefore disjoint, their union is the dataset, and their sizes differ by at most one: with
each replica's pool training its shard exactly once (:class:`~deltaserve.core.pool.SamplePool`),
every sample is trained exactly once per epoch across the replicas, without any replica talking
to another. A new order each epoch lets a sample meet different batch-mates, as one replica's
per-epoch shuffle does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from deltaserve.core.errors import require


@dataclass(frozen=True)
class DataShard:
    rank: int
    world_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        require(self.world_size >= 1, "world_size", self.world_size, "must be >= 1")
        require(0 <= self.rank < self.world_size, "rank", self.rank,
                f"must be in [0, world_size={self.world_size})")

    def check_dataset(self, num_samples: int) -> None:
        """Every replica needs a sample in every epoch (an empty shard would never end one)."""
        require(num_samples >= self.world_size, "dataset", num_samples,
                f"has fewer samples than the {self.world_size} data-parallel replicas")

    def ids(self, num_samples: int, epoch: int) -> tuple[int, ...]:
        """This replica's samples in ``epoch``, in the epoch's order."""
        order = list(range(num_samples))
        # one order per (seed, epoch), independent of the pool's own candidate shuffle
        random.Random(f"deltaserve-shard:{self.seed}:{epoch}").shuffle(order)
        return tuple(order[self.rank::self.world_size])
