"""The activation buffer: each decoder layer's residual-stream input for the training rows.

Rows are reserved at admission (``core.BufferLedger``), filled by the host's capture hooks during
the forward, read by the backward process, and released after it commits (or discarded when a
training-only step is aborted). The tensors live in shared memory on CPU; on a GPU they are CUDA
tensors, which torch.multiprocessing hands to the backward process by CUDA IPC.

``save="residual"`` keeps N_layers × hidden values per token. ``save="residual+mlp"`` also keeps
the base outputs of the frozen gate and up projections, so the recompute skips those two matmuls
(the largest in a layer) at (N_layers × (hidden + 2·intermediate)) values per token.
``offload`` keeps the buffer in pinned host memory while the model runs on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from deltaserve.core.errors import coerce_enum, require
from deltaserve.model.config import ModelConfig


class BufferSave(StrEnum):
    """What the buffer keeps per token and layer (see the module docstring)."""

    RESIDUAL = "residual"
    RESIDUAL_MLP = "residual+mlp"


@dataclass(frozen=True)
class BufferConfig:
    capacity_tokens: int
    save: BufferSave = BufferSave.RESIDUAL
    offload: bool = False

    def __post_init__(self) -> None:
        require(self.capacity_tokens > 0, "buffer_tokens", self.capacity_tokens, "must be > 0")
        coerce_enum(self, "save", BufferSave, "buffer_save")

    @property
    def saves_mlp(self) -> bool:
        return self.save is BufferSave.RESIDUAL_MLP


class ActivationBuffer:
    def __init__(self, config: BufferConfig, model: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        device = torch.device(device)
        if config.offload:
            require(device.type == "cuda" and torch.cuda.is_available(), "buffer_offload", True,
                    "offload moves the buffer from GPU memory to pinned host memory; with the "
                    "model on the CPU the buffer is already in host memory")
        self.config = config
        self.model_config = model
        store = torch.device("cpu") if config.offload else device
        pin = config.offload

        def alloc(width: int) -> torch.Tensor:
            t = torch.zeros((model.num_layers, config.capacity_tokens, width), dtype=dtype,
                            device=store, pin_memory=pin)
            return t.share_memory_() if store.type == "cpu" and not pin else t

        self.residual = alloc(model.hidden_size)
        self.gate = alloc(model.intermediate_size) if config.saves_mlp else None
        self.up = alloc(model.intermediate_size) if config.saves_mlp else None

    @property
    def bytes_per_token(self) -> int:
        width = self.model_config.hidden_size
        if self.config.saves_mlp:
            width += 2 * self.model_config.intermediate_size
        return self.model_config.num_layers * width * self.residual.element_size()

    def write_residual(self, layer: int, start: int, rows: torch.Tensor) -> None:
        self.residual[layer, start:start + rows.shape[0]].copy_(rows, non_blocking=True)

    def write_mlp(self, layer: int, start: int, gate: torch.Tensor, up: torch.Tensor) -> None:
        assert self.gate is not None and self.up is not None
        n = gate.shape[0]
        self.gate[layer, start:start + n].copy_(gate, non_blocking=True)
        self.up[layer, start:start + n].copy_(up, non_blocking=True)
