"""Prompt tokens arriving at a host per second, over a recent window.

On a phase-separated host (SGLang: prefill first), every prompt that arrives while a decode
step waits runs before it. The queue a step's view holds is priced into the TPOT slack
already; prompts not yet arrived are not, and under a burst they kept arriving through the
gap: a yield priced against the queue it saw ended with the decodes waiting on prompts that
came after it (``docs/results.md``, SGLang). This measures how fast they have been coming, so
the slack can keep room for them (:func:`deltaserve.core.slo.tpot_slack_s`).

What arrived is read off the host's queue, not off a separate arrival feed: the prompt tokens
a view holds (waiting, and in the proposed step) less what was there at the last view and has
not run since. A queue that shrank without running (an abort) counts no arrival.
"""

from __future__ import annotations

import collections
import math

from deltaserve.core.errors import require


class PromptArrivals:
    """Prompt tokens seen arriving, timed by the view that first held them."""

    def __init__(self, window_s: float):
        require(math.isfinite(window_s) and window_s > 0, "arrival_window_s", window_s,
                "must be a finite number of seconds > 0")
        self.window_s = window_s
        self._queued_tokens = 0  # unprocessed prompt tokens at the last view, less those run
        self._arrived: collections.deque[tuple[float, int]] = collections.deque()
        self._in_window_tokens = 0

    def seen(self, now_s: float, queued_tokens: int) -> None:
        """A view at ``now_s`` holds ``queued_tokens`` unprocessed prompt tokens."""
        new = queued_tokens - self._queued_tokens
        self._queued_tokens = queued_tokens
        if new > 0:
            self._arrived.append((now_s, new))
            self._in_window_tokens += new
        self._expire(now_s)

    def ran(self, prefill_tokens: int) -> None:
        """A step processed ``prefill_tokens`` of the queued prompts."""
        self._queued_tokens = max(0, self._queued_tokens - prefill_tokens)

    def tokens_per_s(self, now_s: float) -> float:
        """Prompt tokens that arrived over the last ``window_s`` seconds, per second."""
        self._expire(now_s)
        return self._in_window_tokens / self.window_s

    def _expire(self, now_s: float) -> None:
        while self._arrived and self._arrived[0][0] <= now_s - self.window_s:
            self._in_window_tokens -= self._arrived.popleft()[1]
