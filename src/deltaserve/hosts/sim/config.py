"""The simulated GPU host's configuration, and the KV-cache capacity its GPU memory holds.

Its engine knobs are those of a vLLM server on the simulated GPU, not the embedded CPU engine's:
256 sequences per step (vLLM's default), the model's whole context (8,192 positions for
Llama-3-8B), 16-token KV blocks, 90 % of the GPU's memory for the engine
(``gpu_memory_utilization``, vLLM's default), and chunked prefill with a budget of 1,024 tokens
per step. The budget is set from the TPOT objective, as Sarathi-Serve (Agrawal et al., OSDI'24)
sets its chunk size from the TBT SLO: on the A100 profile a 1,024-token step takes ~100 ms, under
the paper's 120 ms max TPOT, where vLLM's 2,048 (~192 ms) would break every decode sharing a
step with a full chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.core.errors import require
from deltaserve.hosts.config import HostConfig
from deltaserve.hosts.sim.catalogue import ModelShape, ProfileEntry

FP16_BYTES = 2
# Activations of the largest step, CUDA graphs, the sampler's logits and library workspaces
# (cuBLAS, NCCL): what vLLM's start-up profiling run subtracts from the memory it gives the KV
# cache; 1–2 GiB for an 8B model at 2,048 batched tokens.
ENGINE_RESERVE_BYTES = int(1.5 * 2**30)
# AdamW keeps an fp32 master copy, its gradient and two moments per trainable parameter, plus the
# fp16 copy the host's LoRA kernels read.
ADAPTER_BYTES_PER_PARAM = 4 * 4 + 2


@dataclass(frozen=True)
class SimHostConfig(HostConfig):
    """:class:`HostConfig` for a simulated GPU. ``gpu``/``model`` name a catalogue entry
    (``deltaserve.hosts.sim.catalogue``); ``tp``: tensor-parallel degree of the host;
    ``network``: the collective profile (default: the entry's first); ``vidur_dir``: the profile
    data (default: see ``catalogue.resolve_vidur_dir``); ``noise``: per-step run-to-run spread
    from the profiles. ``kv_cache_tokens`` caps the KV capacity that the GPU memory left after
    weights, the engine's reserve and co-serving's buffers holds (see :func:`memory_budget`)."""

    model: str = "llama-3-8b"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = 8192
    kv_cache_tokens: int = 1 << 40  # no cap: the GPU memory decides
    gpu: str = "a100"
    tp: int = 1
    network: str | None = None
    vidur_dir: str | None = None
    noise: bool = True
    block_size: int = 16
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.tp >= 1, "tp", self.tp, "must be >= 1")
        require(self.block_size >= 1, "block_size", self.block_size, "must be >= 1")
        require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
                self.gpu_memory_utilization, "must be in (0, 1]")


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes of one GPU of a TP group, and the KV tokens (of the whole group) they leave."""

    usable_bytes: int
    weights_bytes: int
    engine_reserve_bytes: int
    coserving_bytes: int
    kv_bytes_per_token: int  # on one GPU: its share of the KV heads, every layer

    @property
    def kv_bytes(self) -> int:
        return self.usable_bytes - self.weights_bytes - self.engine_reserve_bytes \
            - self.coserving_bytes

    @property
    def kv_tokens(self) -> int:
        return max(0, self.kv_bytes // self.kv_bytes_per_token)


def memory_budget(entry: ProfileEntry, tp: int, utilization: float, buffer_tokens: int,
                  lora_params: int) -> MemoryBudget:
    """What an engine on ``entry``'s GPU at TP ``tp`` has for its KV cache. Co-serving keeps
    the activation buffer (every layer's residual input of ``buffer_tokens`` rows, replicated on
    each TP rank) and the adapter's training state (``lora_params`` split across ranks)."""
    shape: ModelShape = entry.shape
    buffer_bytes = buffer_tokens * shape.num_layers * shape.hidden * FP16_BYTES
    adapter_bytes = lora_params * ADAPTER_BYTES_PER_PARAM // tp
    budget = MemoryBudget(
        usable_bytes=int(entry.gpu_memory_bytes * utilization),
        weights_bytes=shape.num_params * FP16_BYTES // tp,
        engine_reserve_bytes=ENGINE_RESERVE_BYTES,
        coserving_bytes=buffer_bytes + adapter_bytes,
        kv_bytes_per_token=shape.num_layers * shape.kv_bytes_per_token_per_layer(tp))
    require(budget.kv_tokens > 0, "gpu_memory_utilization", utilization,
            f"{entry.gpu}/{entry.model} at TP {tp} leaves no memory for the KV cache")
    return budget
