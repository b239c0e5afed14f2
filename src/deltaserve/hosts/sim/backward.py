"""The backward process's time: a batch of captured training samples into seconds.

The backward (docs/architecture.md, "The backward process") walks the layers top-down. For each
layer it recomputes the layer's forward from the captured input (the same eager forward the host
ran for these rows, LoRA included) and back-propagates through it: activation gradients through the
frozen base weights and the LoRA gradients, ``backward_to_forward`` times the forward. That
per-layer unit is also the grain at which it yields: it checks the grant at every layer boundary,
so a prefill that takes the GPU waits at most one unit (plus the flag poll). Above the layers it
runs the final norm and LM head forward and backward for the loss; after them, one AdamW step over
the adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from deltaserve.core.errors import require
from deltaserve.hosts.sim.catalogue import ModelShape
from deltaserve.hosts.sim.modelled import AdapterShape, ModelledParams, adamw_seconds
from deltaserve.hosts.sim.oracle import SimBatch, StepTimeOracle


@dataclass(frozen=True)
class BackwardJob:
    """One backward batch: the token length of each sample in it."""

    sample_lens: tuple[int, ...]
    tp: int = 1

    def __post_init__(self) -> None:
        require(bool(self.sample_lens), "sample_lens", self.sample_lens, "needs a sample")
        require(min(self.sample_lens) > 0, "sample_lens", self.sample_lens, "must be > 0")

    @property
    def num_tokens(self) -> int:
        return sum(self.sample_lens)


@dataclass(frozen=True)
class BackwardTime:
    """Seconds of one backward job by part (``total_s`` = the sum)."""

    layer_unit_s: float
    layers_s: float
    head_s: float
    optimizer_s: float

    @property
    def total_s(self) -> float:
        return self.layers_s + self.head_s + self.optimizer_s


@runtime_checkable
class BackwardCost(Protocol):
    """What a simulated backward asks: a job's time by part, over ``num_layers`` layers."""

    @property
    def num_layers(self) -> int: ...

    def time(self, job: BackwardJob) -> BackwardTime: ...

    def seconds(self, job: BackwardJob) -> float: ...


class BackwardModel:
    """Prices backward jobs with any :class:`StepTimeOracle` and the modelled parameters."""

    def __init__(self, oracle: StepTimeOracle, shape: ModelShape,
                 params: ModelledParams | None = None, lora: AdapterShape | None = None):
        self.oracle = oracle
        self.shape = shape
        self.params = params or ModelledParams()
        self.lora = lora or AdapterShape()

    @property
    def num_layers(self) -> int:
        return self.oracle.num_layers

    def _forward_batch(self, job: BackwardJob) -> SimBatch:
        # the recompute is the training rows' own eager forward; its capture copy is not redone,
        # but the difference is one HBM copy per layer (see capture_layer_seconds)
        return SimBatch(ft_lens=job.sample_lens, tp=job.tp)

    def layer_unit_seconds(self, job: BackwardJob) -> float:
        """Recompute plus backward of one layer: the grain of the grant pause."""
        forward = self.oracle.layer_seconds(self._forward_batch(job))
        return forward * (1.0 + self.params.backward_to_forward)

    def pause_granularity_seconds(self, job: BackwardJob) -> float:
        """The longest a prefill waits for the backward to yield: one layer unit plus the poll."""
        return self.layer_unit_seconds(job) + self.params.grant_poll_s

    def time(self, job: BackwardJob) -> BackwardTime:
        unit = self.layer_unit_seconds(job)
        head = self.oracle.head_seconds(job.num_tokens, job.tp) * (
            1.0 + self.params.backward_to_forward)
        optimizer = adamw_seconds(self.params, self.lora, self.shape, self.oracle.hbm_bytes_per_s)
        polls = self.oracle.num_layers * self.params.grant_poll_s
        return BackwardTime(layer_unit_s=unit, layers_s=self.oracle.num_layers * unit + polls,
                            head_s=head, optimizer_s=optimizer)

    def seconds(self, job: BackwardJob) -> float:
        return self.time(job).total_s
