"""What the replay needs from a host. The embedded engine and the vLLM host both provide it;
``attach``/``detach`` live beside each host (``deltaserve.hosts.<name>.coserve``)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from deltaserve.core.calibration import HostLimits
from deltaserve.core.contract import StepRecord
from deltaserve.hosts.native.request import SamplingParams, TokenCallback


@runtime_checkable
class ServingHost(Protocol):
    tokenizer: Any
    coserver: Any  # deltaserve.train.coserver.CoServer | None
    latency_model: Any  # deltaserve.core.LatencyModel | None
    record_steps: bool
    step_log: list[StepRecord]

    @property
    def limits(self) -> HostLimits: ...

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    adapter: str | None = None, callback: TokenCallback | None = None,
                    request_id: str | None = None) -> str:
        """Thread-safe; ``callback`` receives a RequestOutput after every token."""
        ...

    def run_loop(self, stop: threading.Event, idle_wait_s: float = 0.005) -> None:
        """Drive the engine until ``stop`` is set."""
        ...

    def has_unfinished(self) -> bool: ...
