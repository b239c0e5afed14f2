"""The SGLang host's configuration: :class:`HostConfig` plus SGLang's own knobs, and the SGLang
server arguments both are turned into."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang.srt.server_args import ServerArgs

from deltaserve.core.errors import require
from deltaserve.hosts.config import HostConfig
from deltaserve.model.lora import ALL_MODULES, LoRAConfig

# What DeltaServe needs of SGLang whichever way it runs (in process or SGLang's own server):
# each step observed before the next is planned (no overlap schedule), LoRA on, and the waiting
# queue served in arrival order (the co-server predicts SGLang's next prefill from it; hidden
# training requests wait behind every client).
REQUIRED_ARGS: dict[str, Any] = {"disable_overlap_schedule": True, "enable_lora": True,
                                 "schedule_policy": "fcfs"}
# SGLang's CPU path: CUDA-free attention and LoRA kernels.
CPU_ARGS: dict[str, Any] = {"device": "cpu", "attention_backend": "torch_native",
                            "lora_backend": "torch_native"}


@dataclass(frozen=True)
class SGLangConfig(HostConfig):
    """:class:`HostConfig` mapped onto SGLang's server arguments (``max_num_batched_tokens``
    is both ``chunked_prefill_size`` and ``max_prefill_tokens``, ``max_num_seqs`` is
    ``max_running_requests``, ``kv_cache_tokens`` is ``max_total_tokens``, ``seed`` is
    ``random_seed``), plus SGLang's own knobs. ``mem_fraction_static`` is a share of the memory
    *available* when SGLang measures it; on a shared machine other processes move that number,
    and ``max_total_tokens`` bounds the KV cache anyway. The LoRA pool holds
    ``max_loras_per_batch`` adapters (the training adapter and clients') of rank up to
    ``max_lora_rank`` on ``lora_target_modules``, all fixed when SGLang starts."""

    mem_fraction_static: float = 0.5
    max_lora_rank: int = LoRAConfig.r  # the default training adapter fits
    max_loras_per_batch: int = 4
    lora_target_modules: tuple[str, ...] = ALL_MODULES
    log_level: str = "warning"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 < self.mem_fraction_static <= 1, "mem_fraction_static",
                self.mem_fraction_static, "must be in (0, 1]")
        require(self.max_lora_rank >= 1, "max_lora_rank", self.max_lora_rank, "must be >= 1")
        require(self.max_loras_per_batch >= 2, "max_loras_per_batch", self.max_loras_per_batch,
                "must be >= 2 (the training adapter and a client's)")
        bad = [m for m in self.lora_target_modules if m not in ALL_MODULES]
        require(not bad, "lora_target_modules", bad, f"choose from {', '.join(ALL_MODULES)}")

    def server_args(self, model_path: str, dtype: str, model_len: int) -> Any:
        """SGLang's ``ServerArgs`` for this config (``dtype`` resolved, e.g. ``float32``)."""
        return ServerArgs(
            model_path=model_path, dtype=dtype, context_length=model_len,
            max_total_tokens=self.kv_cache_tokens, max_running_requests=self.max_num_seqs,
            chunked_prefill_size=self.max_num_batched_tokens,
            max_prefill_tokens=self.max_num_batched_tokens, random_seed=self.seed,
            mem_fraction_static=self.mem_fraction_static, max_lora_rank=self.max_lora_rank,
            max_loras_per_batch=self.max_loras_per_batch,
            lora_target_modules=list(self.lora_target_modules), log_level=self.log_level,
            **REQUIRED_ARGS, **CPU_ARGS)
