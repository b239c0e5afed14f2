"""The embedded engine's configuration."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.core.errors import require
from deltaserve.hosts.config import HostConfig
from deltaserve.model.lora import ALL_MODULES, DEFAULT_TARGETS, LoRAConfig


@dataclass(frozen=True)
class EngineConfig(HostConfig):
    """:class:`HostConfig` plus the embedded engine's own knobs. Requests wait for free KV
    blocks and are preempted (recomputed later) when decodes run out of them. ``cuda_graphs``:
    on a CUDA device, decode-only steps replay CUDA graphs captured at start-up for batch sizes
    1, 2, 4, … ``max_num_seqs`` (ignored elsewhere). The graphs apply LoRA through
    ``graph_lora_slots`` static adapter slots of rank up to ``graph_lora_rank`` on
    ``graph_lora_modules``: decodes on the base model, the training adapter or clients' adapters
    replay as long as a step's adapters fit (else it runs eager). Every graph step pays for the
    slots' low-rank matmuls, used or not; ``graph_lora_slots=0`` captures base-model graphs only
    (decodes carrying any adapter then run eager)."""

    block_size: int = 16
    cuda_graphs: bool = True
    graph_lora_slots: int = 4
    graph_lora_rank: int = LoRAConfig.r  # the default training adapter fits
    graph_lora_modules: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.block_size >= 1, "block_size", self.block_size, "must be >= 1")
        require(self.kv_cache_tokens >= self.block_size, "kv_cache_tokens",
                self.kv_cache_tokens, f"must hold at least one block of {self.block_size}")
        require(self.graph_lora_slots >= 0, "graph_lora_slots", self.graph_lora_slots,
                "must be >= 0 (0: graphs for base-model decodes only)")
        require(self.graph_lora_rank >= 1, "graph_lora_rank", self.graph_lora_rank,
                "must be >= 1")
        require(len(self.graph_lora_modules) > 0, "graph_lora_modules",
                self.graph_lora_modules, "at least one module")
        bad = [m for m in self.graph_lora_modules if m not in ALL_MODULES]
        require(not bad, "graph_lora_modules", bad,
                f"unknown; choose from {', '.join(ALL_MODULES)}")

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size
