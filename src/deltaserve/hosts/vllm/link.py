"""The process-local meeting point of the scheduler subclass, the worker's hooks and the
co-server of one vLLM engine.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.config import VllmConfig
from vllm.lora.request import LoRARequest
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from deltaserve.core.contract import CoServingHooks, TrainingStep
from deltaserve.core.shape import ExecMode, StepShape

if TYPE_CHECKING:  # these modules import this one
    from deltaserve.hosts.vllm.calibrate import CalibrationRun
    from deltaserve.hosts.vllm.publish import AdapterPublisher
    from deltaserve.hosts.vllm.scheduler import CoServingScheduler

# An executed step: its shape, forward seconds, fine-tuning tokens, aborted, and the seconds
# from its schedule() to this call (StepRecord.span_s).
StepListener = Callable[[StepShape, float, int, bool, float], None]


@dataclass(eq=False)
class RowLayout:
    """vLLM's side of one step's training rows, handed from the scheduler to the worker's hooks.

    ``req_ids``: the hidden requests of ``step.rows``, in that order (vLLM flattens a step by
    its own request order, so the hooks look each one up). ``valid``: every request ran whole
    and each layer was captured; the hooks clear it when vLLM's batch does not hold a request
    whole or the capture path had nothing to read, and the step is then reported aborted.
    """

    step: TrainingStep
    req_ids: tuple[str, ...]
    valid: bool = True


@dataclass(frozen=True)
class ForwardRecord:
    """One model forward as the worker measured it. ``mode``: vLLM's CUDA-graph dispatch decision
    for it. ``layers_run``: decoder layers computed (fewer when a training-only step was cut
    short)."""

    seconds: float
    mode: ExecMode
    num_tokens: int
    layers_run: int
    aborted: bool = False


@dataclass(eq=False)
class EngineLink:
    """Shared state of one engine. ``scheduler``/``runner``: DeltaServe's scheduler and the
    worker's model runner (its hooks installed), registered by themselves. ``coserver``: the
    attached co-server. ``train_lora``: vLLM's ``LoRARequest`` of the reserved training adapter.
    ``direct_lora``: the worker's hooks add that adapter to the training rows themselves
    (:mod:`.direct_lora`), so the samples run as base-model requests (:attr:`sample_lora`).
    ``calibration``: a running calibration plan. ``rows``: the training rows of the step being
    dispatched. ``steps``: non-empty steps so far. ``on_step``: told of every executed step (the
    host's timeline and inference-only refit). ``on_shutdown``: called when vLLM shuts the
    engine down (detaches the co-server, checkpointing). ``idle_wait_s``: how long an engine
    loop with no client work may lend the machine to the backward inside ``schedule()`` (0
    where the host's own loop does it). ``wake``: set by a client arrival; it ends a yield to
    the backward before a step early. ``None`` where no arrival can reach this process while the
    engine thread waits (the serving process: vLLM's input thread queues requests for the busy
    loop, which is the thread that would wait), so the engine never yields there: a request
    arriving during a yield would wait it out unpriced."""

    scheduler: CoServingScheduler | None = None
    runner: GPUModelRunner | None = None
    coserver: CoServingHooks | None = None
    train_lora: LoRARequest | None = None
    direct_lora: bool = False
    publisher: AdapterPublisher | None = None
    calibration: CalibrationRun | None = None
    rows: RowLayout | None = None
    last_forward: ForwardRecord | None = None
    steps: int = 0
    on_step: StepListener | None = None
    on_shutdown: Callable[[], None] | None = None
    idle_wait_s: float = 0.0
    wake: threading.Event | None = None

    @property
    def sample_lora(self) -> LoRARequest | None:
        """The ``LoRARequest`` a training sample's hidden request carries."""
        return None if self.direct_lora else self.train_lora

    def take_forward(self) -> ForwardRecord | None:
        rec, self.last_forward = self.last_forward, None
        return rec


_LINKS: dict[int, tuple[weakref.ref[VllmConfig], EngineLink]] = {}
_LOCK = threading.Lock()


def link_for(vllm_config: VllmConfig) -> EngineLink:
    """The link of the engine built from ``vllm_config`` (created on first use)."""
    key = id(vllm_config)
    with _LOCK:
        entry = _LINKS.get(key)
        if entry is not None and entry[0]() is vllm_config:
            return entry[1]
        link = EngineLink()
        _LINKS[key] = (weakref.ref(vllm_config, lambda _r, k=key: _LINKS.pop(k, None)), link)
        return link


def find_link(vllm_config: VllmConfig) -> EngineLink | None:
    entry = _LINKS.get(id(vllm_config))
    return entry[1] if entry is not None and entry[0]() is vllm_config else None
