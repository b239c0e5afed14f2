"""The fine-tuning sample pool: exactly once per epoch, across aborts and crashes.

A sample is *available*, *claimed* (admitted into a step, its activations in flight) or
*committed* (its gradient is in the adapter). ``claim`` takes available samples, ``release``
returns claimed ones, ``commit`` retires claimed ones. An epoch ends when every sample is
committed; the next one makes them all available again. Candidates come out in increasing length
(the admission order); equal lengths come out in a seeded per-epoch shuffle.

A data-parallel replica's pool holds its :class:`~deltaserve.core.shard.DataShard`: each epoch
only the shard's samples become available (the others are *elsewhere*: another replica trains
them), and the epoch ends when they are all committed.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum

from deltaserve.core.errors import require
from deltaserve.core.shard import DataShard

_STATE_COUNTS = ("epoch", "num_samples", "tokens_committed_total", "samples_committed_total")


class PoolStateError(RuntimeError):
    """A claim/commit/release that breaks the exactly-once protocol (a bug in the caller)."""


class _State(IntEnum):
    AVAILABLE = 0
    CLAIMED = 1
    COMMITTED = 2
    ELSEWHERE = 3  # another data-parallel replica's this epoch


@dataclass(frozen=True)
class PoolProgress:
    epoch: int  # 0-based epoch in progress (== num_epochs once finished)
    num_epochs: int | None
    num_samples: int  # trained by this pool each epoch (its shard's, when data-parallel)
    samples_committed: int  # in the current epoch
    samples_claimed: int
    tokens_committed_total: int  # over all epochs
    samples_committed_total: int

    @property
    def finished(self) -> bool:
        return self.num_epochs is not None and self.epoch >= self.num_epochs


class SamplePool:
    """Samples are ids ``0..len(lengths)-1``; ``lengths[i]`` is sample i's token count.
    ``shard``: this data-parallel replica's share of each epoch (``None``: every sample)."""

    def __init__(self, lengths: Sequence[int], *, num_epochs: int | None = 1, seed: int = 0,
                 shard: DataShard | None = None):
        require(len(lengths) > 0, "dataset", len(lengths), "the dataset has no samples")
        require(all(n > 0 for n in lengths), "lengths", min(lengths),
                "every sample needs >= 1 token")
        require(num_epochs is None or num_epochs >= 1, "num_epochs", num_epochs,
                "must be >= 1 (or None for no end)")
        if shard is not None:
            shard.check_dataset(len(lengths))
        self._lengths = tuple(int(n) for n in lengths)
        self.num_epochs = num_epochs
        self.seed = seed
        self.shard = shard
        self._state = [_State.AVAILABLE] * len(self._lengths)
        self._num_members = len(self._lengths)  # samples this pool trains in the epoch
        self._buckets: dict[int, dict[int, None]] = {}
        self._sorted_lens: list[int] = []
        self._epoch = 0
        self._num_committed = 0
        self._num_claimed = 0
        self._tokens_total = 0
        self._samples_total = 0
        self._fill(self._enter_epoch())

    # ---- queries ----------------------------------------------------------------------------
    def __len__(self) -> int:
        """Available samples."""
        return self._num_members - self._num_committed - self._num_claimed

    @property
    def num_samples(self) -> int:
        return len(self._lengths)

    @property
    def is_empty(self) -> bool:
        return not self._sorted_lens

    @property
    def epoch(self) -> int:
        return self._epoch

    def length(self, sample_id: int) -> int:
        return self._lengths[sample_id]

    def smallest_available(self) -> int | None:
        """Length of the shortest available sample."""
        return self._sorted_lens[0] if self._sorted_lens else None

    def iter_available(self) -> Iterator[tuple[int, int]]:
        """``(sample_id, length)`` of available samples in increasing length. Claiming while
        iterating is not allowed; collect the ids first."""
        for n in self._sorted_lens:
            for sid in self._buckets[n]:
                yield sid, n

    def iter_buckets(self) -> Iterator[tuple[int, int]]:
        """``(length, count)`` of available samples in increasing length: the candidate order of
        :meth:`iter_available`, one run of equal lengths at a time."""
        buckets = self._buckets
        for n in self._sorted_lens:
            yield n, len(buckets[n])

    def progress(self) -> PoolProgress:
        return PoolProgress(self._epoch, self.num_epochs, self._num_members, self._num_committed,
                            self._num_claimed, self._tokens_total, self._samples_total)

    # ---- transitions ------------------------------------------------------------------------
    def claim(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        state, available = self._state, _State.AVAILABLE
        for sid in ids:
            if not (0 <= sid < len(state) and state[sid] is available):
                self._expect(sid, available, "claim")
        if len(set(ids)) != len(ids):
            raise PoolStateError(f"claim: duplicate sample ids in {ids}")
        for sid in ids:
            n = self._lengths[sid]
            bucket = self._buckets[n]
            del bucket[sid]
            if not bucket:
                del self._buckets[n]
                del self._sorted_lens[bisect.bisect_left(self._sorted_lens, n)]
            state[sid] = _State.CLAIMED
        self._num_claimed += len(ids)

    def claim_first(self, k: int) -> list[int]:
        """Claim the first ``k`` samples of :meth:`iter_available` (admission's greedy prefix)."""
        ids: list[int] = []
        state, claimed = self._state, _State.CLAIMED
        while len(ids) < k and self._sorted_lens:
            n = self._sorted_lens[0]
            bucket = self._buckets[n]
            if len(bucket) <= k - len(ids):  # the whole run of this length
                take = list(bucket)
                del self._buckets[n]
                self._sorted_lens.pop(0)
            else:
                take = list(itertools.islice(bucket, k - len(ids)))
                for sid in take:
                    del bucket[sid]
            for sid in take:
                state[sid] = claimed
            ids += take
        self._num_claimed += len(ids)
        return ids

    def release(self, ids: Iterable[int]) -> None:
        """Return claimed samples to the pool (aborted step, lost backward)."""
        ids = self._claimed_ids(ids, "release")
        self._num_claimed -= len(ids)
        self._fill(ids, shuffle=False)

    def commit(self, ids: Iterable[int]) -> None:
        """Retire claimed samples whose gradients reached the adapter."""
        ids = self._claimed_ids(ids, "commit")
        for sid in ids:
            self._state[sid] = _State.COMMITTED
            self._tokens_total += self._lengths[sid]
        self._num_claimed -= len(ids)
        self._num_committed += len(ids)
        self._samples_total += len(ids)
        if self._num_committed == self._num_members:
            self._next_epoch()

    # ---- persistence ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Progress to checkpoint. Claimed samples are saved as available: their gradients are
        not in the adapter a checkpoint holds."""
        return {
            "epoch": self._epoch,
            "num_epochs": self.num_epochs,
            "seed": self.seed,
            "num_samples": len(self._lengths),
            "committed": [i for i, s in enumerate(self._state) if s is _State.COMMITTED],
            "tokens_committed_total": self._tokens_total,
            "samples_committed_total": self._samples_total,
            **({"shard": self._shard_key()} if self.shard is not None else {}),
        }

    @staticmethod
    def check_state(state: object) -> None:
        """Raise :class:`InputError` unless ``state`` has the shape :meth:`state_dict` gives (a
        checkpoint's copy may be damaged), naming the first bad field."""
        require(isinstance(state, dict), "pool", state, "must be an object")
        for key in _STATE_COUNTS:
            v = state.get(key)
            require(isinstance(v, int) and not isinstance(v, bool) and v >= 0, f"pool.{key}", v,
                    "must be an integer >= 0")
        v = state.get("seed")
        require(isinstance(v, int) and not isinstance(v, bool), "pool.seed", v,
                "must be an integer")
        v = state.get("num_epochs")
        require(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                "pool.num_epochs", v, "must be an integer >= 1 or null")
        ids = state.get("committed")
        n = state["num_samples"]
        require(isinstance(ids, list) and all(isinstance(i, int) and 0 <= i < n for i in ids)
                and len(set(ids)) == len(ids), "pool.committed", ids,
                f"must be distinct sample ids in [0, {n})")

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state``. A data-parallel replica's pool also takes an unsharded state
        (the group's, :mod:`deltaserve.train.group_ledger`, of any number of replicas): its
        shard of the epoch, less what the group committed. When that leaves it nothing, its
        share of the epoch is trained and it enters the next (holding back, as after its last
        step). Its totals then count its own commits from the resume on."""
        self.check_state(state)
        require(state["num_samples"] == len(self._lengths), "num_samples", state["num_samples"],
                f"the checkpoint was made for a dataset of {state['num_samples']} samples, "
                f"this one has {len(self._lengths)}")
        group = self.shard is not None and state.get("shard") is None
        require(group or state.get("shard") == self._shard_key(), "pool.shard",
                state.get("shard"), f"the checkpoint was made for data-parallel shard "
                f"{state.get('shard')} ([rank, world_size, seed]), this pool has "
                f"{self._shard_key()}")
        finished = state["num_epochs"] is not None and state["epoch"] >= state["num_epochs"]
        # a finished pool still holds the last epoch's samples, all committed
        members_epoch = state["epoch"] - 1 if finished else state["epoch"]
        committed = set(state["committed"])
        if self.shard is not None:
            mine = set(self.shard.ids(len(self._lengths), members_epoch))
            others = committed - mine
            require(group or not others, "pool.committed", sorted(others),
                    "holds samples of another data-parallel shard")
            committed &= mine
        self.num_epochs = state["num_epochs"]
        self.seed = state["seed"]
        self._epoch = state["epoch"]
        self._tokens_total = 0 if group else state["tokens_committed_total"]
        self._samples_total = 0 if group else state["samples_committed_total"]
        self._state = [_State.AVAILABLE] * len(self._lengths)
        self._buckets, self._sorted_lens = {}, []
        self._num_claimed = 0
        members = self._enter_epoch(members_epoch)
        for sid in committed:
            self._state[sid] = _State.COMMITTED
        self._num_committed = len(committed)
        if finished:
            return
        if self._num_committed == self._num_members:  # this shard's part of the epoch is trained
            self._next_epoch()
            return
        # the epoch's own shuffle, less what is committed: the remaining samples come out
        # in the order the uninterrupted epoch would have given them
        order = self._epoch_order(members)
        self._fill([i for i in order if i not in committed], shuffle=False)

    # ---- internals --------------------------------------------------------------------------
    def _claimed_ids(self, ids: Iterable[int], action: str) -> list[int]:
        """``ids`` as a list, checked before any change: each claimed, none twice (a duplicate
        would count one sample twice and leave it claimed)."""
        ids = list(ids)
        for sid in ids:
            self._expect(sid, _State.CLAIMED, action)
        if len(set(ids)) != len(ids):
            raise PoolStateError(f"{action}: duplicate sample ids in {ids}")
        return ids

    def _expect(self, sid: int, state: _State, action: str) -> None:
        if not 0 <= sid < len(self._lengths):
            raise PoolStateError(f"{action}: sample {sid} is not in the pool")
        if self._state[sid] is not state:
            raise PoolStateError(f"{action}: sample {sid} is {self._state[sid].name.lower()}, "
                                 f"expected {state.name.lower()}")

    def _epoch_order(self, ids: Iterable[int]) -> list[int]:
        """A new epoch's seeded order (equal lengths come out in it)."""
        ids = list(ids)
        random.Random(self.seed * 1_000_003 + self._epoch).shuffle(ids)
        return ids

    def _fill(self, ids: Iterable[int], shuffle: bool = True) -> None:
        ids = self._epoch_order(ids) if shuffle else list(ids)
        for sid in ids:
            n = self._lengths[sid]
            self._state[sid] = _State.AVAILABLE
            bucket = self._buckets.get(n)
            if bucket is None:
                bucket = self._buckets[n] = {}
                bisect.insort(self._sorted_lens, n)
            bucket[sid] = None

    def _next_epoch(self) -> None:
        self._epoch += 1
        if self.num_epochs is not None and self._epoch >= self.num_epochs:
            return  # finished: every sample stays committed, nothing is available
        self._num_committed = 0
        self._fill(self._enter_epoch())

    def _enter_epoch(self, epoch: int | None = None) -> Sequence[int]:
        """The samples of ``epoch`` (default: the current one) for this pool, in the shard's
        order; under a shard, every other sample is marked elsewhere (no claim can take it)."""
        n = len(self._lengths)
        if self.shard is None:
            return range(n)
        members = self.shard.ids(n, self._epoch if epoch is None else epoch)
        self._state = [_State.ELSEWHERE] * n
        self._num_members = len(members)
        return members

    def _shard_key(self) -> list[int] | None:
        s = self.shard
        return None if s is None else [s.rank, s.world_size, s.seed]
