"""The process-local meeting point of the scheduler subclass, the worker extension and the
co-server of one in-process vLLM engine.

vLLM hands the scheduler no handle on the executor and the worker no handle on the scheduler.
With the uniproc executor (this host's only mode: the engine core and its one worker run in one
process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` for ``vllm.LLM``, or inside the engine-core process
of ``deltaserve serve``) both receive the *same* ``VllmConfig`` object, so an :class:`EngineLink`
keyed by that object's identity joins them. Everything here is touched only by the engine's own
thread.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deltaserve.core.admission import AdmissionPlan
from deltaserve.core.contract import StepRecord
from deltaserve.core.shape import ExecMode

Capture = Callable[[int, Any], None]


@dataclass
class TrainingRows:
    """The training rows of the step being dispatched, as the scheduler hands them to the worker.

    ``req_ids``: the hidden requests, in the order their rows are captured (the plan's sample
    order: :meth:`CoServer.capture` writes them as one contiguous run of the buffer).
    ``lengths``: tokens of each. ``capture``: where each layer's rows go. ``should_abort``: asked
    at every layer boundary of a training-only step (``abortable``). The worker fills
    ``aborted_at`` (the first layer not run) and sets ``valid`` False if the step's token layout
    does not hold every request whole (nothing is then captured).
    """

    req_ids: tuple[str, ...]
    lengths: tuple[int, ...]
    capture: Capture
    should_abort: Callable[[], bool] | None = None
    abortable: bool = False
    plan: AdmissionPlan | None = None
    valid: bool = True
    aborted_at: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


@dataclass(frozen=True)
class ForwardRecord:
    """One model forward as the worker measured it. ``mode``: vLLM's CUDA-graph dispatch decision
    for it (``NONE`` → eager). ``layers_run``: decoder layers computed (fewer when a
    training-only step was cut short)."""

    seconds: float
    mode: ExecMode
    num_tokens: int
    layers_run: int
    aborted: bool = False


@dataclass(eq=False)
class EngineLink:
    """Shared state of one engine. ``scheduler``/``worker``: the DeltaServe scheduler and the
    worker's hook set, registered by themselves. ``coserver``: the attached co-server (None when
    inference only). ``train_lora``: vLLM's ``LoRARequest`` of the reserved training adapter.
    ``calibration``: a running calibration plan. ``latency_model``: refit with every step when no
    co-server is attached (inference-only runs). ``idle_wait_s``: how long an idle engine loop that
    only waits for the backward may block inside ``schedule()`` (0 when the host loop waits)."""

    scheduler: Any = None
    worker: Any = None
    host: Any = None
    coserver: Any = None
    train_lora: Any = None
    publisher: Any = None
    calibration: Any = None
    latency_model: Any = None
    rows: TrainingRows | None = None
    last_forward: ForwardRecord | None = None
    forwards: int = 0  # model forwards the worker's hooks saw (none inside a CUDA-graph replay)
    steps: int = 0  # non-empty steps the scheduler observed
    record_steps: bool = False
    step_log: list[StepRecord] = field(default_factory=list)
    on_step: Callable[[StepRecord], None] | None = None
    idle_wait_s: float = 0.0
    remote: dict[str, Any] | None = None  # attach state inside ``deltaserve serve``'s engine

    def take_forward(self) -> ForwardRecord | None:
        rec, self.last_forward = self.last_forward, None
        return rec


_LINKS: dict[int, tuple[weakref.ref, EngineLink]] = {}
_LOCK = threading.Lock()


def link_for(vllm_config: Any) -> EngineLink:
    """The link of the engine built from ``vllm_config`` (created on first use)."""
    key = id(vllm_config)
    with _LOCK:
        entry = _LINKS.get(key)
        if entry is not None and entry[0]() is vllm_config:
            return entry[1]
        link = EngineLink()
        _LINKS[key] = (weakref.ref(vllm_config, lambda _r, k=key: _LINKS.pop(k, None)), link)
        return link


def find_link(vllm_config: Any) -> EngineLink | None:
    entry = _LINKS.get(id(vllm_config))
    return entry[1] if entry is not None and entry[0]() is vllm_config else None
