"""The ``vllm.LLM`` that DeltaServe starts: its configuration, the keyword arguments that plug the
co-serving scheduler and worker extension in, and the per-step limits read back from vLLM."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deltaserve.core.calibration import Batching, HostLimits
from deltaserve.core.errors import InputError, require, require_choice

SCHEDULER_CLS = "deltaserve.hosts.vllm.scheduler.CoServingScheduler"
WORKER_EXTENSION_CLS = "deltaserve.hosts.vllm.worker_ext.CoServingWorkerExtension"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class VLLMHostConfig:
    """The ``vllm.LLM`` DeltaServe starts. ``model``: a Hugging Face directory, a ``.gguf`` or a
    built-in name (``smollm2``). ``max_loras``: adapters per step, the reserved training adapter
    included (it is pinned to one slot). ``max_lora_rank``: at least the training adapter's ``r``.
    ``capture``: ``auto``, ``hooks`` or ``aux`` (see :mod:`hooks`). ``interrupt``: cut
    training-only steps short when a client request arrives. ``enforce_eager``: decoder-layer
    hooks only run in eager mode (CPU with LoRA is eager regardless). ``num_threads``: torch
    threads of the engine (vLLM otherwise drops to one on CPU). ``engine``: any other
    ``vllm.LLM`` keyword arguments."""

    model: str = "smollm2"
    dtype: str = "float32"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    max_loras: int = 2
    max_lora_rank: int = 16
    seed: int = 0
    capture: str = "auto"
    interrupt: bool = True
    enforce_eager: bool = True
    num_threads: int | None = None
    engine: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require_choice("dtype", self.dtype, tuple(_DTYPES))
        require_choice("capture", self.capture, ("auto", "hooks", "aux"))
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_loras", "max_lora_rank"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        require(self.max_model_len >= 2, "max_model_len", self.max_model_len, "must be >= 2")
        require(self.num_threads is None or self.num_threads >= 1, "num_threads",
                self.num_threads, "must be >= 1")
        clash = {"scheduler_cls", "worker_extension_cls", "enable_lora",
                 "async_scheduling"} & set(self.engine)
        require(not clash, "engine", sorted(clash), "set by DeltaServe; remove them")


def engine_kwargs(config: VLLMHostConfig | None = None) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` that plug DeltaServe in (``model`` excluded)::

        llm = vllm.LLM(model=path, **engine_kwargs(VLLMHostConfig(max_loras=2)))
    """
    c = config or VLLMHostConfig()
    extra = dict(c.engine)
    if wants_aux_model(c):  # the compile-safe capture: vLLM builds aux_model's Llama
        from deltaserve.hosts.vllm.aux_model import HF_OVERRIDES

        extra["hf_overrides"] = {**extra.get("hf_overrides", {}), **HF_OVERRIDES}
    return dict(
        dtype=c.dtype, max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
        max_model_len=c.max_model_len, enable_prefix_caching=c.enable_prefix_caching,
        enable_lora=True, max_loras=c.max_loras, max_lora_rank=c.max_lora_rank, seed=c.seed,
        enforce_eager=c.enforce_eager, async_scheduling=False, scheduler_cls=SCHEDULER_CLS,
        worker_extension_cls=WORKER_EXTENSION_CLS, **extra)


def engine_limits(vllm_config: Any, scheduler: Any) -> HostLimits:
    """What one step of the engine holds. A sample is a prompt that must leave room for the one
    token vLLM samples after it, hence ``max_model_len - 1``."""
    sc, cc = vllm_config.scheduler_config, vllm_config.cache_config
    return HostLimits(scheduler.max_num_scheduled_tokens, sc.max_num_seqs,
                      vllm_config.model_config.max_model_len - 1,
                      cc.num_gpu_blocks * scheduler.block_size, Batching.MIXED)


def wants_aux_model(config: VLLMHostConfig) -> bool:
    """The compile-safe capture needs vLLM to build the aux-output model: asked for, or implied
    by a compiled model (``auto`` without ``enforce_eager``; on CPU, LoRA never compiles)."""
    from deltaserve.hosts.vllm.version import is_cpu_build

    return config.capture == "aux" or (
        config.capture == "auto" and not config.enforce_eager and not is_cpu_build())


def start_llm(vllm: Any, path: str, config: VLLMHostConfig) -> Any:
    if wants_aux_model(config):
        import json

        from deltaserve.hosts.vllm.aux_model import BASE_ARCHITECTURE, register_aux_capture_model

        archs = json.loads((Path(path) / "config.json").read_text()).get("architectures")
        if archs != [BASE_ARCHITECTURE]:
            raise InputError("capture", "aux", f"the compile-safe capture supports "
                             f"{BASE_ARCHITECTURE} checkpoints; this model is {archs}")
        register_aux_capture_model()
    return vllm.LLM(model=path, **engine_kwargs(config))


