"""Seconds the garbage collector held this process, for a host's step records.

A collection runs on whichever thread allocates when the collector's counts say so, and holds
the interpreter for its whole length: inside a host's step, or between two, it is time no
latency model prices and no hook of the co-server holds. One process-wide callback
(``gc.callbacks``, installed by the first :class:`GcClock`) adds each collection's length to a
running total; each clock reads how much the total grew since it last looked.
"""

from __future__ import annotations

import gc
import threading
import time

_lock = threading.Lock()
_total_s = 0.0  # every collection's length since the callback was installed
_started_s: float | None = None
_installed = False


def _on_collection(phase: str, info: dict[str, int]) -> None:
    """``gc.callbacks`` entry: time each collection from its start to its stop. A collection
    runs with the interpreter held, so the two phases of one collection come in order."""
    global _total_s, _started_s
    if phase == "start":
        _started_s = time.perf_counter()
    elif _started_s is not None:
        _total_s += time.perf_counter() - _started_s
        _started_s = None


def collected_s() -> float:
    """Seconds spent in garbage collection since the first clock was made."""
    return _total_s


class GcClock:
    """How long the collector held the process between two :meth:`take` calls."""

    def __init__(self) -> None:
        global _installed
        with _lock:
            if not _installed:
                gc.callbacks.append(_on_collection)
                _installed = True
        self._last_s = collected_s()

    def take(self) -> float:
        """Seconds collected since the previous call (or since the clock was made)."""
        now_s = collected_s()
        seconds, self._last_s = now_s - self._last_s, now_s
        return seconds
