"""The engine's own state of a request (the client-visible half lives in
:class:`deltaserve.hosts.base.ClientRequest`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

from deltaserve.core.requests import SamplingParams


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Request:
    """One request inside the engine. ``num_computed`` counts tokens whose KV is in the cache;
    on preemption it drops to 0 and prompt + output so far are recomputed. ``token_times_s``:
    when each output token came out (``time.monotonic()``), for the co-server's SLO view."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    arrival_s: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)
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
