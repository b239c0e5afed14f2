"""Row accounting of the activation buffer, without the tensor: what admission reserves.

A sample holds one contiguous run of rows (one row per token). First fit over a sorted free list
keeps reservations O(free runs); capacity is small (hundreds to a few thousand rows).
"""

from __future__ import annotations

import bisect
import itertools
from typing import NamedTuple

from deltaserve.core.errors import InputError, require


class RowSpan(NamedTuple):
    """Rows ``[start, start + length)``. A NamedTuple: admission makes one per sample per step,
    and a frozen dataclass costs several times more to build."""

    start: int
    length: int

    @property
    def stop(self) -> int:
        return self.start + self.length


class BufferLedger:
    """Reserve/free rows of a buffer with ``capacity_tokens`` rows."""

    def __init__(self, capacity_tokens: int):
        require(capacity_tokens > 0, "capacity_tokens", capacity_tokens, "must be > 0")
        self.capacity_tokens = capacity_tokens
        self._free: list[tuple[int, int]] = [(0, capacity_tokens)]  # sorted (start, length)
        self._held: dict[int, tuple[int, int]] = {}  # sample id -> (start, length)

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.used_tokens

    @property
    def used_tokens(self) -> int:
        return sum(n for _, n in self._held.values())

    @property
    def largest_free_run(self) -> int:
        return max((n for _, n in self._free), default=0)

    def holds(self, sample_id: int) -> bool:
        return sample_id in self._held

    def span(self, sample_id: int) -> RowSpan:
        return RowSpan(*self._held[sample_id])

    def reserve(self, sample_id: int, num_tokens: int) -> RowSpan | None:
        """Rows for one sample, or ``None`` when no contiguous run is long enough."""
        if sample_id in self._held:
            raise InputError("sample_id", sample_id, "already holds buffer rows")
        require(num_tokens > 0, "num_tokens", num_tokens, "must be > 0")
        for i, (start, length) in enumerate(self._free):
            if length >= num_tokens:
                if length == num_tokens:
                    del self._free[i]
                else:
                    self._free[i] = (start + num_tokens, length - num_tokens)
                span = RowSpan(start, num_tokens)
                self._held[sample_id] = (start, num_tokens)
                return span
        return None

    def reserve_many(self, ids: list[int], lens: list[int]) -> int | None:
        """Rows for samples ``ids`` of ``lens`` tokens as one contiguous run, split in order;
        returns the run's first row, or ``None`` (nothing reserved) when no free run holds them
        all. Admission calls this once per step, so it does no per-sample object work."""
        if not self._held.keys().isdisjoint(ids) or len(set(ids)) != len(ids):
            sid = next(i for k, i in enumerate(ids) if i in self._held or i in ids[:k])
            raise InputError("sample_id", sid, "already holds buffer rows")
        total = sum(lens)
        for i, (start, length) in enumerate(self._free):
            if length >= total:
                if length == total:
                    del self._free[i]
                else:
                    self._free[i] = (start + total, length - total)
                break
        else:
            return None
        starts = itertools.accumulate(lens[:-1], initial=start)
        self._held.update(zip(ids, zip(starts, lens, strict=True), strict=True))
        return start

    def free(self, sample_id: int) -> None:
        span = self._held.pop(sample_id, None)
        if span is None:
            raise InputError("sample_id", sample_id, "holds no buffer rows")
        i = bisect.bisect_left(self._free, (span[0], 0))
        self._free.insert(i, span)
        # merge with neighbours so free runs stay maximal
        if i + 1 < len(self._free) and self._free[i][0] + self._free[i][1] == self._free[i + 1][0]:
            self._free[i] = (self._free[i][0], self._free[i][1] + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]
