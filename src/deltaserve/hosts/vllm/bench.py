"""The vLLM host for ``deltaserve bench --host vllm``: a :class:`VLLMHost` sized like the
benchmark's embedded engine, with this package's attach/detach."""

from __future__ import annotations

from typing import Any

from deltaserve.core.errors import InputError

# vLLM accepts only these ``max_lora_rank`` values.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
CPU_BLOCK_SIZE = 128  # vLLM's KV block on CPU


def lora_rank_for(r: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds rank ``r``."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise InputError("lora_r", r, f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")


def make_vllm_host(cfg: Any, threads: int) -> Any:
    """A ``HostKit`` for a :class:`deltaserve.bench.config.BenchConfig`."""
    from deltaserve.bench.hosts import HostKit
    from deltaserve.hosts.vllm.config import VLLMHostConfig
    from deltaserve.hosts.vllm.coserve import attach, detach
    from deltaserve.hosts.vllm.host import VLLMHost

    blocks = max(1, cfg.kv_cache_tokens // CPU_BLOCK_SIZE)
    host = VLLMHost(VLLMHostConfig(
        model=cfg.model, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=cfg.max_model_len,
        max_lora_rank=lora_rank_for(cfg.lora_r), seed=cfg.seed, num_threads=threads,
        engine={"num_gpu_blocks_override": blocks}))
    return HostKit(host, attach, detach, host.close)
