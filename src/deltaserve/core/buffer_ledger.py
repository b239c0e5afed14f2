"""Row accounting of the activation buffer, without the tensor: what admission reserves.

A sample holds one contiguous run of rows (one row per token). First fit over a sorted free list
keeps reservations O(free runs); capacity is small (hundreds to a few thousand rows).
"""

from __future__ import annotations

import bisect
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
        self._held: dict[int, RowSpan] = {}

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.used_tokens

    @property
    def used_tokens(self) -> int:
        return sum(s.length for s in self._held.values())

    @property
    def largest_free_run(self) -> int:
        return max((n for _, n in self._free), default=0)

    def holds(self, sample_id: int) -> bool:
        return sample_id in self._held

    def span(self, sample_id: int) -> RowSpan:
        return self._held[sample_id]

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
                self._held[sample_id] = span
                return span
        return None

    def reserve_many(self, items: list[tuple[int, int]]) -> list[RowSpan] | None:
        """Rows for several ``(sample_id, num_tokens)`` as one contiguous run, split in order;
        ``None`` (nothing reserved) when no run holds them all."""
        total = sum(n for _, n in items)
        for i, (start, length) in enumerate(self._free):
            if length >= total:
                if length == total:
                    del self._free[i]
                else:
                    self._free[i] = (start + total, length - total)
                break
        else:
            return None
        spans = []
        for sid, n in items:
            if sid in self._held:
                raise InputError("sample_id", sid, "already holds buffer rows")
            span = self._held[sid] = RowSpan(start, n)
            spans.append(span)
            start += n
        return spans

    def free(self, sample_id: int) -> None:
        span = self._held.pop(sample_id, None)
        if span is None:
            raise InputError("sample_id", sample_id, "holds no buffer rows")
        i = bisect.bisect_left(self._free, (span.start, 0))
        self._free.insert(i, (span.start, span.length))
        # merge with neighbours so free runs stay maximal
        if i + 1 < len(self._free) and self._free[i][0] + self._free[i][1] == self._free[i + 1][0]:
            self._free[i] = (self._free[i][0], self._free[i][1] + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]
