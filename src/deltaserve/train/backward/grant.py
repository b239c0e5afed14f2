"""The grant: one shared byte saying whether the backward process may compute.

The host clears it while inference needs the machine; the backward checks it before every layer.
It is deliberately not a ``multiprocessing.Event``: ``Event.set()`` waits until every sleeping
waiter has acknowledged its wake-up, so a backward killed while paused on the grant (OOM killer,
a crash, ``SIGKILL``) would hang the host on its next ``set()`` forever. A bare byte has no lock
and no waiter bookkeeping for a dead process to leave behind.

A paused backward sleeps in the kernel on a pipe the host writes one byte into at every
``set()``, instead of polling the byte: a waiter woken thousands of times a second took time
slices from the host's threads while a job was in flight (``benchmarks/grant_wait.py``). A write
never blocks: a full pipe already holds the wake-up a waiter needs, and a byte written while no
backward waits, or for a killed one, is a spurious wake-up its successor drains and checks.

A grant may carry a deadline (a yield: the host lends the machine until a step is due). The
backward then starts a layer only if the layer, as long as it took last time, ends by the
deadline: a layer is not interruptible, and one that ran past the yield would delay the step the
host takes the machine back for by the rest of it (the layer through the LM head and the loss
is several decoder layers long). Both processes read ``time.monotonic()``, one clock on Linux.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from multiprocessing.context import BaseContext


class Grant:
    def __init__(self, ctx: BaseContext):
        self._flag = ctx.Value("b", 1, lock=False)  # set: the backward may compute
        self._until_s = ctx.Value("d", math.inf, lock=False)  # ... layers that end by then
        # seconds of the unit the backward waits to start (0: it waits for none)
        self._waiting_s = ctx.Value("d", 0.0, lock=False)
        # the wake-up pipe: the waiter reads, the host writes (one byte per set)
        self._wake_r, self._wake_w = ctx.Pipe(duplex=False)
        # only the process that built the grant (the host) writes: non-blocking once, here
        os.set_blocking(self._wake_w.fileno(), False)

    @property
    def waiting_s(self) -> float:
        """What the unit the backward waits to start would cost (0 while it waits for none):
        a yield shorter than that gives it nothing to do."""
        return float(self._waiting_s.value)

    @waiting_s.setter
    def waiting_s(self, seconds: float) -> None:
        self._waiting_s.value = seconds

    def set(self, until_s: float = math.inf) -> None:
        """Let the backward compute; with ``until_s`` (``time.monotonic()``), only layers that
        end by then."""
        self._until_s.value = until_s  # before the flag: a reader never sees a stale deadline
        self._flag.value = 1
        fd = self._wake_w.fileno()
        # a full pipe already holds a wake-up (the host keeps the read end open: no EPIPE)
        with contextlib.suppress(BlockingIOError, BrokenPipeError):
            os.write(fd, b"\0")

    def clear(self) -> None:
        self._flag.value = 0

    def is_set(self) -> bool:
        return bool(self._flag.value)

    def admits(self, layer_s: float) -> bool:
        """Set, and a layer of ``layer_s`` seconds started now ends by its deadline."""
        return bool(self._flag.value) and time.monotonic() + layer_s <= self._until_s.value

    def wait(self, timeout_s: float | None = None, layer_s: float = 0.0) -> bool:
        """Block until it admits a layer of ``layer_s`` seconds; ``False`` if ``timeout_s``
        passes first. Only a ``set()`` can make a grant admit what it did not (a deadline only
        comes closer), and each one leaves a byte in the pipe, so the waiter sleeps until one
        arrives: checked after draining, a ``set()`` racing the check is never missed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.admits(layer_s):
            left_s = None if deadline is None else deadline - time.monotonic()
            if left_s is not None and left_s <= 0:
                return False
            if self._wake_r.poll(left_s):
                self._drain()
        return True

    def _drain(self) -> None:
        fd = self._wake_r.fileno()
        os.set_blocking(fd, False)  # in the waiter's process: its descriptor came through spawn
        with contextlib.suppress(BlockingIOError):
            while os.read(fd, 4096):
                pass
