"""Requests, their sampling parameters and what clients receive."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, auto

from deltaserve.core.errors import require


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 is greedy. ``seed`` makes sampling reproducible per request.
    ``stop``: strings that end the output (excluded from it); needs the engine's tokenizer."""

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


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(frozen=True)
class RequestOutput:
    """What a client sees: after every new token (``finished`` False) and once at the end."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    text: str | None
    finished: bool
    finish_reason: str | None  # "length", "stop", "eos"
    arrival_s: float
    first_token_s: float | None
    token_times_s: tuple[float, ...]


TokenCallback = Callable[[RequestOutput], None]
_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One client request inside the engine. ``num_computed`` counts tokens whose KV is in the
    cache; on preemption it drops to 0 and prompt + output so far are recomputed."""

    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    callback: TokenCallback | None = None
    arrival_s: float = 0.0
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def first_token_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None

    @property
    def last_token_s(self) -> float | None:
        return self.token_times_s[-1] if self.token_times_s else None

    @property
    def in_prefill(self) -> bool:
        """Tokens other than the newest one still need a forward."""
        return self.num_computed < self.num_tokens - 1

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, tuple(self.prompt_token_ids),
                             tuple(self.output_token_ids), self.text,
                             self.status is Status.FINISHED, self.finish_reason, self.arrival_s,
                             self.first_token_s, tuple(self.token_times_s))
