"""Engine configuration."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.core.errors import require, require_choice


@dataclass(frozen=True)
class EngineConfig:
    """``model``: a Hugging Face directory, a ``.gguf`` file or a built-in name (``smollm2``).
    ``max_num_batched_tokens``: tokens per step (prefills are chunked to fit).
    ``kv_cache_tokens``: KV-cache capacity; requests wait for free blocks and are preempted
    (recomputed later) when decodes run out of them.
    ``max_model_len``: longest prompt + output (default: the model's limit, capped at 4096).
    ``dtype``: weights and activations; ``auto`` takes bfloat16 where the hardware has native
    bf16 matmul (see :func:`deltaserve.model.loading.resolve_dtype`).
    ``cuda_graphs``: on a CUDA device, decode steps of base-model requests replay CUDA graphs
    captured at start-up for batch sizes 1, 2, 4, … ``max_num_seqs`` (ignored elsewhere)."""

    model: str = "smollm2"
    dtype: str = "float32"
    device: str = "cpu"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_tokens: int = 65_536
    num_threads: int | None = None
    seed: int = 0
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        require_choice("dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
                self.max_num_batched_tokens, "must be >= 1")
        require(self.block_size >= 1, "block_size", self.block_size, "must be >= 1")
        require(self.kv_cache_tokens >= self.block_size, "kv_cache_tokens",
                self.kv_cache_tokens, f"must hold at least one block of {self.block_size}")
        require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
                self.max_model_len, "must be >= 2")
        require(self.max_model_len is None or self.max_model_len <= self.kv_cache_tokens,
                "max_model_len", self.max_model_len,
                f"a sequence must fit the KV cache of {self.kv_cache_tokens} tokens")
        require(self.num_threads is None or self.num_threads >= 1, "num_threads",
                self.num_threads, "must be >= 1")

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size
