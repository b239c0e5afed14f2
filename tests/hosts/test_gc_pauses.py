"""The collector's time is counted once, between the clock's reads that bracket it: a
collection of a large cyclic garbage shows up in the next read, about as long as the caller
timed it from outside, and a read with no collection since shows none."""

from __future__ import annotations

import gc
import time

from deltaserve.hosts.gc_pauses import GcClock


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_a_collection_is_counted_in_the_next_read_only():
    clock, other = GcClock(), GcClock()
    was_enabled = gc.isenabled()
    gc.disable()  # no automatic collection between the reads: only the one timed here
    try:
        clock.take()
        other.take()
        garbage = [_Node() for _ in range(200_000)]
        del garbage
        t0 = time.perf_counter()
        gc.collect()
        outside_s = time.perf_counter() - t0
        counted_s = clock.take()
        assert 0.5 * outside_s <= counted_s <= outside_s
        assert clock.take() == 0.0  # nothing collected since
        assert other.take() == counted_s  # every clock sees the same collection, once
    finally:
        if was_enabled:
            gc.enable()
