"""Replays run with the garbage collector's heap frozen, as vLLM's engine core freezes its own
after start-up (``vllm.utils.gc_utils.freeze_gc_heap``).

A collection of the oldest generation walks every object the collector tracks. Once the
embedded host holds its model, a calibration and a trace, a full collection of the bench
process took 180-185 ms (``results/2026-12-06-native-gc-heap/bench.log``): longer than a
decode step, on whichever thread allocates when the counts say so, so inside a step, as
lateness no latency model can price. On vLLM the engine core has frozen the heap already and
the same collection took 0-1 ms (``results/2026-12-06-vllm-burst-light-r3-frozen-heap/``):
there this changes nothing. Objects frozen before the replay are skipped by every later
collection; the replay's own garbage is still collected. Frozen objects are never freed, so
the freeze ends with the replay (``gc.unfreeze``, as vLLM's engine does at shutdown; that
also ends an engine's own freeze, which its shutdown, right after, would end anyway).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class HeapFreeze:
    """``full_collect_s``: a full collection just before the freeze (what a stall would cost);
    ``frozen_collect_s``: one just after it; ``num_frozen``: objects the collector skips."""

    full_collect_s: float
    frozen_collect_s: float
    num_frozen: int

    @property
    def text(self) -> str:
        return (f"froze {self.num_frozen} objects: a full collection took "
                f"{self.full_collect_s * 1e3:.0f} ms before, {self.frozen_collect_s * 1e3:.1f} ms "
                f"after")


def _timed_collect() -> float:
    t0 = time.perf_counter()
    gc.collect()
    return time.perf_counter() - t0


@contextmanager
def frozen_heap() -> Iterator[HeapFreeze]:
    """Collect, freeze what survives for the ``with`` block, unfreeze after it."""
    full_s = _timed_collect()
    gc.freeze()
    try:
        yield HeapFreeze(full_s, _timed_collect(), gc.get_freeze_count())
    finally:
        gc.unfreeze()
