"""The host contract: the only things a host calls, and the only things the co-server asks of it.

A host adapter turns its engine's proposed batch into a :class:`SchedulingView` and, for every
step::

    step = co.plan(view)                  # Algorithm 1; one TrainingStep object for the step
    ... run view.proposed plus step.rows (if any) on the training adapter; inside the forward,
        at each decoder layer boundary: step.should_abort() on a training-only step, then
        step.capture(layer, rows) (and step.capture_mlp where step.saves_mlp) ...
    co.observe(StepReport(step, shape_that_ran, seconds, aborted, layers_run))

and ``co.on_arrival()`` whenever a client request arrives. Between steps an idle host asks
``co.wants_step()`` (a training-only step, or a backward result, is due) and otherwise lends the
machine with ``co.idle(timeout_s)``; a host that can pause before a step plans it with
:func:`plan_after_yield` instead of ``co.plan``: the backward first gets the seconds the SLOs
leave (``co.yield_budget_s(view)``) through ``co.yield_to_backward``.

Invariants every host keeps:

* Training rows of a step come after its inference rows, in the order of ``step.rows``, each
  sample's tokens contiguous, positions starting at 0, attending only to themselves (causal).
* A training sample is a prefill-only request on the reserved training adapter: one forward, no
  sampled token reaches anyone, nothing another request can reuse (no shared KV/prefix entry).
* ``capture(layer, rows)`` receives the residual-stream input of decoder ``layer`` for exactly
  the training rows, before the layer runs; ``should_abort()`` is asked at the same boundary.
* ``observe`` receives every step that ``plan`` returned, run or not, aborted or not; a step
  whose training rows did not run whole and captured is reported ``aborted`` (its samples go back
  to the pool).

This module imports no engine and, at run time, no torch: tensors and model objects are named
for type checkers only (the ``TYPE_CHECKING`` block).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from deltaserve.core.admission import AdmissionPlan, SchedulingView
from deltaserve.core.calibration import CalibrationConfig, HostLimits
from deltaserve.core.latency_model import LatencyModel, LatencyModelConfig
from deltaserve.core.shape import StepShape
from deltaserve.core.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

    from deltaserve.model.config import ModelConfig
    from deltaserve.model.llama import BaseWeights
    from deltaserve.model.lora import AdapterWeights, LoRAConfig


@dataclass(frozen=True)
class TrainingRows:
    """The fine-tuning samples riding in one step, in the order their rows are laid out.

    ``dropout``: LoRA dropout probability on these rows (0 on hosts whose LoRA forward has none);
    ``dropout_seeds[i]``: the seed sample ``i``'s masks are drawn from, so the backward replays
    them exactly.
    """

    token_ids: tuple[tuple[int, ...], ...] = ()
    dropout: float = 0.0
    dropout_seeds: tuple[int, ...] = ()

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(len(t) for t in self.token_ids)

    @property
    def num_samples(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    def flat_token_ids(self) -> list[int]:
        return [t for ids in self.token_ids for t in ids]

    def positions(self) -> list[int]:
        """Each sample's positions, from 0: the rows attend to their own sample only."""
        return [p for n in self.lengths for p in range(n)]


@runtime_checkable
class TrainingStep(Protocol):
    """One planned step: the admission decision and the hooks its forward calls.

    ``plan.shape`` is the step to run (the host's proposed batch plus ``rows``; eager whenever
    ``rows`` is non-empty). ``abortable``: a training-only step the co-server may cut short when
    a request arrives. ``saves_mlp``: the buffer also keeps each layer's base gate/up outputs.
    """

    @property
    def plan(self) -> AdmissionPlan: ...

    @property
    def rows(self) -> TrainingRows: ...

    @property
    def abortable(self) -> bool: ...

    @property
    def saves_mlp(self) -> bool: ...

    def capture(self, layer: int, hidden: torch.Tensor) -> None:
        """The training rows' residual-stream input of decoder ``layer`` (``[T_ft, hidden]``,
        rows in ``rows`` order), before the layer runs."""
        ...

    def capture_mlp(self, layer: int, gate: torch.Tensor, up: torch.Tensor) -> None:
        """The training rows' base (pre-LoRA) gate and up projections of ``layer``; called only
        where :attr:`saves_mlp`."""
        ...

    def should_abort(self) -> bool:
        """Asked at each layer boundary: ``True`` once a request arrived during this abortable
        step and interruption is on. The host then stops the step (no capture of later layers)
        and reports it ``aborted`` with ``layers_run``."""
        ...


@dataclass(frozen=True)
class StepReport:
    """What happened to a planned step.

    ``shape``: what actually ran (its ``mode`` is the mode the host used). ``seconds``: forward
    wall time. ``aborted``: cut short at a layer boundary, or its training rows did not run whole
    (their samples go back to the pool). ``layers_run``: decoder layers completed.
    """

    step: TrainingStep
    shape: StepShape
    seconds: float
    aborted: bool = False
    layers_run: int | None = None


@dataclass(frozen=True)
class StepRecord:
    """One executed step as a host logs it for timelines (``t_s``: its end, on
    ``time.monotonic()``; ``ft_tokens``: fine-tuning tokens it carried; ``yielded_s``: seconds
    the host lent the backward just before it, 0 where it did not yield; on a simulated host the
    time promised, which an arrival may cut short; ``hooks_s``: seconds the co-server's hooks
    held the host's thread between the step before it and it, 0 without a co-server;
    ``span_s``: seconds from the host starting to build the step to this record (its
    scheduling, the yield and the co-server's hooks in it, the forward, sampling and output
    handling), 0 where the host does not measure it: time between two steps that the later one's
    span leaves out passed outside the host's step, in its loop or other threads and processes;
    ``gc_s``: seconds the host's process spent in garbage collection since the step before's
    record, inside its span or not, 0 on a simulated host)."""

    t_s: float
    shape: StepShape
    seconds: float
    ft_tokens: int
    aborted: bool
    yielded_s: float = 0.0
    hooks_s: float = 0.0
    span_s: float = 0.0
    gc_s: float = 0.0


@runtime_checkable
class CoServingHooks(Protocol):
    """What a host calls: the co-server's side of every step (see the module docstring)."""

    def plan(self, view: SchedulingView) -> TrainingStep:
        """Before dispatch: Algorithm 1 on ``view.proposed``. Admitted samples are claimed and
        hold buffer rows until the step is observed. Takes the machine back from the backward
        for steps that need it (the grant)."""
        ...

    def observe(self, report: StepReport) -> None:
        """After the step: refit the latency model, mark captured samples ready (or return an
        aborted step's samples to the pool), launch the backward at a full batch."""
        ...

    def on_arrival(self) -> None:
        """A client request arrived (any thread): a running abortable step stops at its next
        layer boundary."""
        ...

    def wants_step(self) -> bool:
        """Whether an engine with no client work should still step: a training-only step can
        admit a sample, or captured samples wait for the backward."""
        ...

    def idle(self, timeout_s: float) -> None:
        """The host has nothing to run: the backward may use the whole machine; returns after
        ``timeout_s`` or as soon as a backward result was handled."""
        ...

    def yield_budget_s(self, view: SchedulingView) -> float:
        """Seconds the host may pause before running ``view.proposed`` while every request
        stays inside its SLO (0 when the policy does not lend running time to the backward)."""
        ...

    def yield_to_backward(self, seconds: float, wake: threading.Event) -> float:
        """Let the backward compute for ``seconds`` or until ``wake`` is set; returns the time
        given. The next :meth:`plan` takes the machine back."""
        ...


class TrainingSide(Protocol):
    """The part of :class:`TrainingHost` about the model and the training adapter: what an
    engine host's training side (next to the engine's scheduler) answers for it."""

    @property
    def limits(self) -> HostLimits:
        """Per-step limits and whether prefill and decode share a step."""
        ...

    @property
    def model_path(self) -> str:
        """The base model's directory (PEFT's ``base_model_name_or_path``)."""
        ...

    @property
    def model_config(self) -> ModelConfig: ...

    def backward_weights(self) -> BaseWeights:
        """The base weights the backward process maps: views of the engine's where it can
        (GPU), else a copy loaded for it."""
        ...

    def training_dropout(self, lora: LoRAConfig) -> float:
        """The LoRA dropout the host's forward applies to training rows (0.0 where its LoRA
        kernels have none; the backward must replay the forward that produced the rows)."""
        ...

    def install_training_adapter(self, adapter: AdapterWeights) -> None:
        """Reserve the training adapter's slot with these weights; clients can never name it."""
        ...

    def publish_adapter(self, adapter: AdapterWeights) -> None:
        """Make updated training-adapter weights visible to the host's next forward."""
        ...


@runtime_checkable
class TrainingHost(TrainingSide, Protocol):
    """What the co-server asks of a host (its attach/detach use nothing else)."""

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (training files are tokenized with its chat template)."""
        ...

    def calibrate(self, lora: LoRAConfig, calibration: CalibrationConfig | None,
                  latency: LatencyModelConfig | None, *, seed: int, progress: bool
                  ) -> LatencyModel:
        """Run the calibration plan through the host's own scheduling and forward path (idle
        host) and fit a latency model."""
        ...

    def set_coserver(self, co: CoServingHooks | None) -> None:
        """Start (or stop, with None) calling ``co`` at every step."""
        ...

    def has_unfinished(self) -> bool: ...


def plan_after_yield(co: CoServingHooks, view: SchedulingView, wake: threading.Event,
                     clock: Callable[[], float]) -> TrainingStep:
    """``co.plan(view)``, after lending the backward the machine for the priced budget
    (``co.yield_budget_s``) when ``view.proposed`` holds inference: the one yield every host
    that can pause before a step makes. ``wake``: set by a client arrival (it ends the yield
    early; the host clears it before the arrivals the view already holds). ``clock``: the clock
    of ``view.now_s``, read again after the yield (nothing the view holds changes during it:
    arrivals reach the engine between steps)."""
    if view.proposed.has_inference:
        pause_s = co.yield_budget_s(view)
        if pause_s > 0:  # the SLOs have room: the backward gets the machine first
            co.yield_to_backward(pause_s, wake)
            view = replace(view, now_s=clock())
    return co.plan(view)
