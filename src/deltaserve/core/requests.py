"""What clients send and receive, the same on every host: sampling parameters and outputs.

Engine-internal request state (KV blocks, computed tokens) stays in each host; these types are
the client half that every host shares (:class:`deltaserve.hosts.base.BaseHost`), the bench's
replay and the server.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from deltaserve.core.errors import require


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 is greedy. ``seed`` makes sampling reproducible per request.
    ``stop``: strings that end the output (excluded from it); needs the host's tokenizer."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        require(self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1")
        require(math.isfinite(self.temperature) and self.temperature >= 0, "temperature",
                self.temperature, "must be a finite number >= 0")
        require(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        require(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
                "stop strings must be non-empty strings")


@dataclass(frozen=True)
class RequestOutput:
    """What a client sees: after every new token (``finished`` False) and once at the end.
    Times are ``time.monotonic()`` seconds. ``finish_reason``: ``length``, ``stop``, ``eos`` or
    ``abort``."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    text: str | None
    finished: bool
    finish_reason: str | None
    arrival_s: float
    first_token_s: float | None
    token_times_s: tuple[float, ...]


TokenCallback = Callable[[RequestOutput], None]
