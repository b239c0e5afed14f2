"""The sample book: where every fine-tuning sample is, from admission to commit.

A sample is *available* in the pool, *claimed* by an admitted step (holding buffer rows and a
dropout seed), *ready* once its step's forward captured it, in the backward, and *committed*
when its gradient reached the adapter (its rows freed). An aborted step or a lost backward job
releases its samples back to the pool, so each is trained exactly once per epoch. Admission
(:class:`deltaserve.core.admission.AdmissionScheduler`) claims from :attr:`pool` and reserves
rows in :attr:`ledger`; everything after that goes through this class.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from deltaserve.core.admission import AdmissionPlan
from deltaserve.core.buffer_ledger import BufferLedger
from deltaserve.core.calibration import HostLimits
from deltaserve.core.contract import TrainingRows
from deltaserve.core.data import TrainingSample
from deltaserve.core.errors import require
from deltaserve.core.pool import PoolProgress, SamplePool
from deltaserve.core.shard import DataShard
from deltaserve.train.backward.messages import JobSample
from deltaserve.train.checkpoint_store import dataset_fingerprint


class SampleBook:
    def __init__(self, samples: Sequence[TrainingSample], *, num_epochs: int | None, seed: int,
                 buffer_tokens: int, pool: SamplePool | None = None,
                 shard: DataShard | None = None):
        """``pool``: one shared with other books (replicas of one process, each with its own
        buffer); it must hold these samples. By default the book makes its own. ``shard``: a
        data-parallel replica's share of every epoch (a given pool must hold the same one)."""
        self.samples = list(samples)
        self.seed = seed
        if pool is None:
            pool = SamplePool([s.num_tokens for s in self.samples], num_epochs=num_epochs,
                              seed=seed, shard=shard)
        require(pool.num_samples == len(self.samples), "pool", pool.num_samples,
                f"a shared pool must hold this dataset's {len(self.samples)} samples")
        require(pool.shard == shard, "pool", pool.shard,
                f"a given pool must train this replica's data-parallel shard {shard}")
        self.pool = pool
        self.ledger = BufferLedger(buffer_tokens)
        self.fingerprint = dataset_fingerprint(self.samples)
        self._seeds: dict[int, int] = {}
        self._ready: list[JobSample] = []

    # ---- admission -> forward ---------------------------------------------------------------
    def rows(self, plan: AdmissionPlan, dropout: float) -> TrainingRows:
        """The admitted samples' rows, each with the dropout seed its masks come from."""
        epoch = self.pool.epoch
        seeds = []
        for sid in plan.sample_ids:
            self._seeds[sid] = dropout_seed(self.seed, epoch, sid)
            seeds.append(self._seeds[sid])
        return TrainingRows(tuple(self.samples[sid].input_ids for sid in plan.sample_ids),
                            dropout, tuple(seeds))

    def captured(self, plan: AdmissionPlan) -> None:
        """The step's forward wrote every admitted sample's rows: they wait for the backward."""
        for s in plan.samples:
            self._ready.append(JobSample(s.sample_id, s.rows.start,
                                         self.samples[s.sample_id].labels,
                                         self._seeds[s.sample_id]))

    # ---- backward batches -------------------------------------------------------------------
    @property
    def ready_tokens(self) -> int:
        return sum(s.length for s in self._ready)

    @property
    def has_ready(self) -> bool:
        return bool(self._ready)

    def take_batch(self, batch_tokens: int) -> tuple[JobSample, ...]:
        """Ready samples in capture order until ``batch_tokens`` is reached (whole samples)."""
        take, n = [], 0
        while self._ready and n < batch_tokens:
            s = self._ready.pop(0)
            take.append(s)
            n += s.length
        return tuple(take)

    def can_admit(self) -> bool:
        """A sample is available and the buffer has a run of rows for the shortest one."""
        smallest = self.pool.smallest_available()
        return smallest is not None and smallest <= self.ledger.largest_free_run

    # ---- outcomes ---------------------------------------------------------------------------
    def commit(self, ids: Iterable[int]) -> int:
        """The samples' gradient is in the adapter; returns the epoch they were trained in."""
        ids = list(ids)
        epoch = self.pool.epoch
        self.pool.commit(ids)
        self._forget(ids)
        return epoch

    def release(self, ids: Iterable[int]) -> None:
        """Back to the pool (an aborted step, a lost backward job, shutdown without drain)."""
        ids = list(ids)
        if ids:
            self.pool.release(ids)
            self._forget(ids)

    def release_ready(self) -> None:
        self.release([s.sample_id for s in self._ready])
        self._ready.clear()

    def progress(self) -> PoolProgress:
        return self.pool.progress()

    def _forget(self, ids: list[int]) -> None:
        for sid in ids:
            self.ledger.free(sid)
            self._seeds.pop(sid, None)


def dropout_seed(seed: int, epoch: int, sample_id: int) -> int:
    """The dropout seed of a sample in an epoch: a new mask every epoch, reproducible."""
    return (seed * 2_654_435_761 + epoch * 40_503 + sample_id) % (2**61 - 1)


def buffer_capacity(buffer_tokens: int | None, batch_tokens: int, limits: HostLimits,
                    samples: Sequence[TrainingSample]) -> int:
    """Activation-buffer rows: ``buffer_tokens``, or one backward batch plus the longest sample;
    every sample must fit the buffer, one host step and the model's context."""
    longest = max((s.num_tokens for s in samples), default=0)
    cap = buffer_tokens or batch_tokens + longest
    require(longest <= cap, "buffer_tokens", cap, f"cannot hold the longest sample "
            f"({longest} tokens); raise it or lower the dataset's max_tokens")
    require(longest <= limits.max_tokens_per_step, "max_tokens", longest,
            f"a sample must fit one step of {limits.max_tokens_per_step} tokens")
    require(longest <= limits.max_model_len, "max_tokens", longest,
            f"a sample must fit the model's context of {limits.max_model_len}")
    return cap
