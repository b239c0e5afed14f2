"""The co-server's configuration, and what it reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from deltaserve.core.admission import AdmissionConfig, Skip
from deltaserve.core.errors import require, require_choice
from deltaserve.core.latency_model import LatencyModelConfig
from deltaserve.core.slo import SLOConfig
from deltaserve.model.lora import LoRAConfig
from deltaserve.train.checkpoint import CheckpointConfig
from deltaserve.train.messages import BackwardDone
from deltaserve.train.optim import OptimizerConfig


@dataclass(frozen=True)
class CoServeConfig:
    """``backward_batch_tokens``: tokens of captured samples per optimizer step (a step takes
    whole samples until it reaches this). ``buffer_tokens``: activation-buffer rows (default:
    one batch plus the longest sample). ``grant_policy``: clear the grant before steps carrying
    prefill or fine-tuning tokens (``prefill``, the design) or before every step with inference
    work (``inference``: for few-core CPUs where decode steps also contend)."""

    slo: SLOConfig
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    latency: LatencyModelConfig = field(default_factory=LatencyModelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    backward_batch_tokens: int = 256
    buffer_tokens: int | None = None
    buffer_save: str = "residual"
    buffer_offload: bool = False
    interrupt: bool = True
    num_epochs: int | None = 1
    seed: int = 0
    backward_threads: int | None = None
    grant_policy: str = "auto"
    yield_to_backward: bool = True
    max_yield_s: float = 0.5

    def __post_init__(self) -> None:
        require(self.backward_batch_tokens > 0, "backward_batch_tokens",
                self.backward_batch_tokens, "must be > 0")
        require(self.buffer_tokens is None or self.buffer_tokens > 0, "buffer_tokens",
                self.buffer_tokens, "must be > 0")
        require(self.backward_threads is None or self.backward_threads >= 1, "backward_threads",
                self.backward_threads, "must be >= 1")
        require_choice("grant_policy", self.grant_policy,
                       ("auto", "prefill", "inference", "partition"))
        require(self.num_epochs is None or self.num_epochs >= 1, "num_epochs", self.num_epochs,
                "must be >= 1")
        require(self.max_yield_s > 0, "max_yield_s", self.max_yield_s, "must be > 0")


@dataclass(frozen=True)
class Commit:
    """An optimizer step as the co-server saw it land (``at_s``: ``time.monotonic()``)."""

    at_s: float
    epoch: int
    done: BackwardDone


@dataclass(frozen=True)
class CoServeStats:
    ft_tokens_committed: int
    ft_samples_committed: int
    ft_tokens_forwarded: int
    optimizer_steps: int
    steps_with_ft: int
    aborted_steps: int
    backward_failures: int
    worker_restarts: int
    epoch: int
    last_loss: float | None
    skips: dict[Skip, int]
