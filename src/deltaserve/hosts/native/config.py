"""The embedded engine's configuration."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.core.errors import require
from deltaserve.hosts.config import HostConfig


@dataclass(frozen=True)
class EngineConfig(HostConfig):
    """:class:`HostConfig` plus the embedded engine's own knobs. Requests wait for free KV
    blocks and are preempted (recomputed later) when decodes run out of them. ``cuda_graphs``:
    on a CUDA device, decode steps of base-model requests replay CUDA graphs captured at start-up
    for batch sizes 1, 2, 4, … ``max_num_seqs`` (ignored elsewhere)."""

    block_size: int = 16
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.block_size >= 1, "block_size", self.block_size, "must be >= 1")
        require(self.kv_cache_tokens >= self.block_size, "kv_cache_tokens",
                self.kv_cache_tokens, f"must hold at least one block of {self.block_size}")

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size
