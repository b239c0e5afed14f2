"""The host contract: how an inference engine and the co-server talk.

A host adapter translates its engine's batch into a :class:`StepShape` and calls the co-server
(:class:`CoServingHooks`) at four points of every step. The co-server asks the host for a few
facts and handles (:class:`Host`). Nothing here depends on an engine or on torch; tensors cross
as opaque objects owned by the host's framework.

Invariants every host keeps:

* Training rows of a step are laid out in the order of ``AdmissionPlan.samples``, each sample's
  tokens contiguous, positions starting at 0, attending only to themselves (causal).
* A training sample is a prefill-only request on the reserved training adapter: it runs one
  forward, produces no sampled token, never reaches a client, and writes nothing another request
  can reuse (no shared KV/prefix cache entry).
* ``capture(layer, rows)`` is called with the residual-stream input of decoder ``layer`` for the
  training rows, before the layer runs; ``should_abort()`` is asked at the same boundary.
* ``observe`` receives every step, including aborted ones, with the wall time the forward took.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from deltaserve.core.admission import AdmissionPlan, SchedulingView
from deltaserve.core.calibration import HostLimits
from deltaserve.core.shape import ExecMode, StepShape


@dataclass(frozen=True)
class StepReport:
    """What happened to one dispatched step.

    ``shape``: what actually ran (its ``mode`` is the mode the host used). ``seconds``: forward
    wall time. ``aborted``: a training-only step cut short at a layer boundary (its samples go
    back to the pool). ``layers_run``: decoder layers completed before an abort.
    """

    plan: AdmissionPlan
    shape: StepShape
    seconds: float
    aborted: bool = False
    layers_run: int | None = None


@dataclass(frozen=True)
class StepRecord:
    """One executed step as a host logs it for timelines (``t_s``: its end, on
    ``time.monotonic()``; ``ft_tokens``: fine-tuning tokens it carried)."""

    t_s: float
    shape: StepShape
    seconds: float
    ft_tokens: int
    aborted: bool


@runtime_checkable
class CoServingHooks(Protocol):
    """What a host calls. Mirrors the four hook points of the design."""

    def plan(self, view: SchedulingView) -> AdmissionPlan:
        """Before dispatch: Algorithm 1 on the host's proposed batch."""
        ...

    def begin_step(self, plan: AdmissionPlan) -> None:
        """The host is about to run ``plan.shape``: clear the grant for prefill-carrying steps."""
        ...

    def capture(self, layer: int, hidden_rows: Any) -> None:
        """Inside the forward: the training rows' input of decoder ``layer``."""
        ...

    def should_abort(self) -> bool:
        """Inside the forward, at each layer boundary of a training-only step."""
        ...

    def observe(self, report: StepReport) -> None:
        """After the step: refit the latency model, retire or return samples, maybe launch
        the backward."""
        ...

    def on_arrival(self) -> None:
        """A client request arrived: abort a running training-only step."""
        ...


@runtime_checkable
class Host(Protocol):
    """What the co-server asks of a host."""

    @property
    def limits(self) -> HostLimits:
        """Per-step limits and whether prefill and decode share a step."""
        ...

    def execution_mode(self, shape: StepShape) -> ExecMode:
        """The mode the host will run ``shape`` in (graph replay or eager)."""
        ...

    def decoder_layers(self) -> Sequence[Any]:
        ...

    def base_weights(self) -> Any:
        """Views of the base model's weights, for the backward process to map."""
        ...

    def publish_adapter(self, lora_state: Any) -> None:
        """Make updated training-adapter weights visible to the host's next forward."""
        ...
