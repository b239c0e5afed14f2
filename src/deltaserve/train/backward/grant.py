"""The grant: one shared byte saying whether the backward process may compute.

The host clears it while inference needs the machine; the backward checks it before every layer.
It is deliberately not a ``multiprocessing.Event``: ``Event.set()`` waits until every sleeping
waiter has acknowledged its wake-up, so a backward killed while paused on the grant (OOM killer,
a crash, ``SIGKILL``) would hang the host on its next ``set()`` forever. A bare byte has no lock
and no waiter bookkeeping for a dead process to leave behind; the cost is that a paused backward
polls, waking at most ``poll_s`` late.
"""

from __future__ import annotations

import time
from multiprocessing.context import BaseContext


class Grant:
    def __init__(self, ctx: BaseContext, poll_s: float = 2e-4):
        self._flag = ctx.Value("b", 1, lock=False)  # set: the backward may compute
        self.poll_s = poll_s

    def set(self) -> None:
        self._flag.value = 1

    def clear(self) -> None:
        self._flag.value = 0

    def is_set(self) -> bool:
        return bool(self._flag.value)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until set; ``False`` if ``timeout_s`` passes first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._flag.value:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(self.poll_s)
        return True
