"""Replays run with the garbage collector's heap frozen, as vLLM's engine core freezes its own
after start-up (``vllm.utils.gc_utils.freeze_gc_heap``).

A collection of the oldest generation walks every object the collector tracks. Once a bench
process holds a model, an engine, a calibration and a trace, that walk took 170-350 ms in the
vLLM bench process (measured 2026-12-06 with a ``gc.callbacks`` probe: 14 such collections
during start-up, one after a run's window), longer than the derived TPOT objective, and it
runs on whichever thread allocates when the counts say so: inside a step, as lateness no
latency model can price. Objects frozen before the replay are skipped by every later
collection; the replay's own garbage is still collected. Frozen objects are never freed, so
the freeze ends with the replay (``gc.unfreeze``, as vLLM's engine does at shutdown).
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
