"""The data-parallel group's ledger: which samples of the dataset the group's one adapter holds.

A replica's own pool holds only its shard of each epoch, but the adapter every replica serves
holds every replica's samples, and its checkpoint is written once, by rank 0. So every global
step's all-reduce also gathers every replica's sample ids of the step
(``BackwardDone.group_sample_ids``), and every replica records them here, in an unsharded
:class:`~deltaserve.core.pool.SamplePool` of the whole dataset that commits them. Its epochs end
where the group's do (:mod:`deltaserve.train.group_steps`: an epoch ends at one global step on
every replica, and no step mixes two), and a sample the group trained twice in an epoch is a
:class:`~deltaserve.core.pool.PoolStateError` here.

Its state is an unsharded pool's, so a checkpoint of N replicas resumes M of them (one
included): each takes its shard of the epoch's untrained samples
(:meth:`SamplePool.load_state_dict`), and the group re-forms at attach as it formed first.
"""

from __future__ import annotations

from collections.abc import Sequence

from deltaserve.core.pool import PoolProgress, SamplePool


class GroupLedger:
    """What the group's adapter holds, as one pool of the whole dataset."""

    def __init__(self, shard_pool: SamplePool):
        self.pool = SamplePool([shard_pool.length(i) for i in range(shard_pool.num_samples)],
                               num_epochs=shard_pool.num_epochs, seed=shard_pool.seed)

    @property
    def epoch(self) -> int:
        return self.pool.epoch

    def progress(self) -> PoolProgress:
        """The group's epoch and what its adapter holds, in samples and tokens."""
        return self.pool.progress()

    def record(self, sample_ids: Sequence[int]) -> None:
        """A global step committed ``sample_ids`` (every replica's) into the adapter."""
        if sample_ids:
            self.pool.claim(sample_ids)
            self.pool.commit(sample_ids)

    def state_dict(self) -> dict:
        return self.pool.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.pool.load_state_dict(state)
