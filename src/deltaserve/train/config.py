"""The co-server's configuration tree. Every default is written here once; the CLI's flags are
generated from these dataclasses (:mod:`deltaserve.cli_flags`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from deltaserve.core.admission import AdmissionConfig
from deltaserve.core.errors import InputError, coerce_enum, require
from deltaserve.core.latency_model import LatencyModelConfig
from deltaserve.core.shard import DataShard
from deltaserve.core.slo import SLOConfig
from deltaserve.core.yield_reserve import YieldReserveConfig
from deltaserve.model.lora import LoRAConfig
from deltaserve.train.buffer import BufferSave
from deltaserve.train.checkpoint_store import CheckpointConfig
from deltaserve.train.optim import OptimizerConfig


class GrantPolicy(StrEnum):
    """When the backward process may compute while the host runs steps.

    * ``prefill`` (the design, for GPUs): the grant is taken back for every step carrying prefill
      or fine-tuning tokens; decode-only steps overlap the backward, since a memory-bound decode
      leaves compute idle.
    * ``exclusive`` (few-core CPUs, where decode steps contend too): the grant is taken back for
      every step and the host waits until the backward has stopped at a layer boundary; the
      backward computes in idle time and in SLO-bounded yields (``yield_to_backward``).
    * ``partition`` (CPUs): the backward owns its own cores (``threads``) for the whole run and
      never pauses; the host runs on the others (not the bench's default, which is ``auto``:
      on this 2-core machine a core of its own leaves inference too little).
    * ``auto``: ``prefill`` where the model is on a GPU, ``exclusive`` elsewhere.
    """

    AUTO = "auto"
    PREFILL = "prefill"
    EXCLUSIVE = "exclusive"
    PARTITION = "partition"


@dataclass(frozen=True)
class BackwardConfig:
    """``batch_tokens``: captured tokens per optimizer step (a step takes whole samples until
    it reaches this). ``buffer_tokens``: activation-buffer rows (default: one batch plus the
    longest sample). ``threads``: the backward's torch threads (default: every core under
    ``exclusive``, one otherwise). ``max_yield_s``: the longest single yield;
    ``yield_reserve``: the slack a yield leaves unspent (:mod:`deltaserve.core.yield_reserve`).
    ``park_timeout_s``: under ``exclusive``, the longest a step waits for the backward to
    stop at its next layer boundary; past it (a hung backward) the step runs beside it, so a
    training fault slows inference but never stops it. ``stop_after_lost_steps``: training
    stops with :class:`~deltaserve.train.lost_steps.TrainingFailed` once this many optimizer
    steps in a row are lost (a backward that fails every job trains nothing; inference goes
    on)."""

    batch_tokens: int = 256
    buffer_tokens: int | None = None
    buffer_save: BufferSave = BufferSave.RESIDUAL
    buffer_offload: bool = False
    threads: int | None = None
    grant_policy: GrantPolicy = GrantPolicy.AUTO
    yield_to_backward: bool = field(default=True, metadata={"flag": "yield"})
    max_yield_s: float = 0.5
    yield_reserve: YieldReserveConfig = field(default_factory=YieldReserveConfig)
    park_timeout_s: float = 1.0
    stop_after_lost_steps: int = 5

    def __post_init__(self) -> None:
        require(self.batch_tokens > 0, "backward_batch_tokens", self.batch_tokens, "must be > 0")
        require(self.buffer_tokens is None or self.buffer_tokens > 0, "buffer_tokens",
                self.buffer_tokens, "must be > 0")
        coerce_enum(self, "buffer_save", BufferSave)
        require(self.threads is None or self.threads >= 1, "backward_threads", self.threads,
                "must be >= 1")
        coerce_enum(self, "grant_policy", GrantPolicy)
        require(self.max_yield_s > 0, "max_yield_s", self.max_yield_s, "must be > 0")
        require(self.park_timeout_s > 0, "park_timeout_s", self.park_timeout_s, "must be > 0")
        require(self.stop_after_lost_steps >= 1, "stop_after_lost_steps",
                self.stop_after_lost_steps, "must be >= 1")


class DataParallelBackend(StrEnum):
    """The ``torch.distributed`` backend of the backward processes' group: ``auto`` is NCCL
    where the model is on a GPU, gloo elsewhere."""

    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"


# torchrun's names for the rendezvous, read by DataParallelConfig.from_env
_ENV_FIELDS = (("WORLD_SIZE", "world_size", int), ("RANK", "rank", int),
               ("MASTER_ADDR", "master_addr", str), ("MASTER_PORT", "master_port", int))


@dataclass(frozen=True)
class DataParallelConfig:
    """Data-parallel co-serving: ``world_size`` replicas train one adapter, their backward
    processes forming one ``torch.distributed`` group (rank ``rank``) that meets at
    ``master_addr:master_port`` (the standard env rendezvous; :meth:`from_env` reads torchrun's
    variables). ``timeout_s``: the longest the group waits to form, or for a peer in a
    collective, before the step fails. One replica (the default) forms no group and trains
    exactly as without this config."""

    world_size: int = 1
    rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    backend: DataParallelBackend = DataParallelBackend.AUTO
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        require(isinstance(self.world_size, int) and self.world_size >= 1, "world_size",
                self.world_size, "must be an integer >= 1")
        require(isinstance(self.rank, int) and 0 <= self.rank < self.world_size, "rank",
                self.rank, f"must be an integer in [0, world_size={self.world_size})")
        require(bool(self.master_addr), "master_addr", self.master_addr, "must not be empty")
        require(isinstance(self.master_port, int) and 0 < self.master_port < 65536,
                "master_port", self.master_port, "must be a port in [1, 65535]")
        coerce_enum(self, "backend", DataParallelBackend)
        require(self.timeout_s > 0, "timeout_s", self.timeout_s, "must be > 0")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **given: object) -> DataParallelConfig:
        """The rendezvous torchrun sets (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``,
        ``MASTER_PORT``); an unset variable keeps the default, ``given`` fields override."""
        kwargs: dict[str, object] = {}
        for var, name, kind in _ENV_FIELDS:
            if var in environ:
                try:
                    kwargs[name] = kind(environ[var])
                except ValueError:
                    raise InputError(var, environ[var], "must be an integer") from None
        return cls(**{**kwargs, **given})


@dataclass(frozen=True)
class CoServeConfig:
    """Everything a co-server needs besides the host and the data. ``interrupt``: cut a
    training-only step short at a layer boundary when a request arrives. ``num_epochs`` None:
    train until stopped. ``valid_every_steps``: with validation samples, their loss is computed
    after every this many optimizer steps and after the last (default: at every checkpoint).
    ``data_parallel``: this co-server is replica ``rank`` of ``world_size`` training one adapter
    (its backward joins the replicas' group, its pool trains its :class:`DataShard` of every
    epoch); the default, one replica, changes nothing. It has no CLI flag of its own: a bench or
    launcher that forms replicas sets it per replica."""

    slo: SLOConfig
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    latency: LatencyModelConfig = field(default_factory=LatencyModelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    backward: BackwardConfig = field(default_factory=BackwardConfig)
    interrupt: bool = True
    num_epochs: int | None = 1
    seed: int = 0
    valid_every_steps: int | None = None
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig,
                                              metadata={"cli": False})

    def __post_init__(self) -> None:
        require(isinstance(self.slo, SLOConfig), "slo", self.slo, "must be an SLOConfig")
        require(isinstance(self.data_parallel, DataParallelConfig), "data_parallel",
                self.data_parallel, "must be a DataParallelConfig")
        require(self.num_epochs is None or self.num_epochs >= 1, "num_epochs", self.num_epochs,
                "must be >= 1")
        require(self.valid_every_steps is None or self.valid_every_steps >= 1,
                "valid_every_steps", self.valid_every_steps, "must be >= 1")

    @property
    def validation_interval(self) -> int:
        return self.valid_every_steps or self.checkpoint.every_steps

    @property
    def data_shard(self) -> DataShard | None:
        """This replica's share of every epoch (``None``: one replica trains every sample). The
        shard's order is seeded by :attr:`seed`, which every replica must share."""
        dp = self.data_parallel
        return DataShard(dp.rank, dp.world_size, self.seed) if dp.distributed else None
