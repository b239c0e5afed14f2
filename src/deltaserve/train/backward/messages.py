"""What crosses the pipe between the co-server and the backward process."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class JobSample:
    """One captured sample: its buffer rows, its labels (Hugging Face convention, unshifted)
    and the seed its LoRA dropout masks were drawn from in the forward."""

    sample_id: int
    row_start: int
    labels: tuple[int, ...]
    dropout_seed: int

    @property
    def length(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class BackwardJob:
    """One optimizer step over ``samples`` (loss: mean over their response tokens). Data
    parallel: ``samples`` may be empty (this replica's empty share of a global step), and
    ``epoch_open`` / ``staying`` are its votes (:mod:`deltaserve.train.group_steps`); one
    replica ignores them."""

    step: int
    samples: tuple[JobSample, ...]
    epoch_open: bool = True
    staying: bool = True

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.samples)


@dataclass(frozen=True)
class BackwardDone:
    """The adapter now holds step ``step``; its samples are committed."""

    step: int
    sample_ids: tuple[int, ...]
    num_tokens: int
    num_loss_tokens: int
    loss: float
    grad_norm: float
    lr: float
    wall_s: float
    paused_s: float  # time spent waiting on the grant flag
    num_correct: int = 0  # loss tokens whose argmax prediction was the target
    allreduce_s: float = 0.0  # data-parallel: the gradient all-reduce, waiting on peers included
    # data parallel: the group's vote totals of this step (group_steps), and whether any
    # replica had a loss token (False: no optimizer step was taken, nothing was published)
    group_epoch_open: int = 0
    group_staying: int = 0
    stepped: bool = True
    # data parallel: every replica's samples of this step (this one's included), in rank order
    group_sample_ids: tuple[int, ...] = ()

    @property
    def mean_token_accuracy(self) -> float:
        return self.num_correct / self.num_loss_tokens if self.num_loss_tokens else 0.0


@dataclass(frozen=True)
class EvalJob:
    """The validation loss of the adapter as it stands after ``step`` committed optimizer steps:
    a forward pass (no dropout, no gradient) over the held-out samples, layer by layer under the
    grant like any backward work, so it never takes the machine from inference."""

    step: int
    input_ids: tuple[tuple[int, ...], ...]
    labels: tuple[tuple[int, ...], ...]  # Hugging Face convention, unshifted


@dataclass(frozen=True)
class EvalDone:
    """``loss``: mean cross-entropy over the held-out samples' response tokens (every token
    weighs the same, whichever sample it is in)."""

    step: int
    loss: float
    num_loss_tokens: int
    num_correct: int
    wall_s: float
    paused_s: float

    @property
    def mean_token_accuracy(self) -> float:
        return self.num_correct / self.num_loss_tokens if self.num_loss_tokens else 0.0


@dataclass(frozen=True)
class LayerDone:
    """The backward of step ``step`` finished decoder layer ``layer`` after ``compute_s``
    seconds of computing (grant waits excluded): the parent's estimate of how long the backward
    takes to stop at a layer boundary."""

    step: int
    layer: int
    compute_s: float


@dataclass(frozen=True)
class BackwardFailed:
    """The step raised; the adapter is unchanged and its samples go back to the pool.
    ``group_lost``: data parallel, the step's all-reduce failed (a peer is gone, or did not
    answer within the group's timeout): the group cannot step again."""

    step: int
    error: str
    group_lost: bool = False


@dataclass(frozen=True)
class WorkerReady:
    """The process has mapped everything and waits for jobs (its start-up, importing torch and
    building the model, is seconds of CPU that must not land on the first served steps)."""

    pid: int


@dataclass(frozen=True)
class Stop:
    pass
