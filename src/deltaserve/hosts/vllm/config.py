"""The ``vllm.LLM`` DeltaServe starts: vLLM's own knobs on top of :class:`HostConfig`, and the
keyword arguments that plug the co-serving scheduler and worker extension in. No vLLM import
here (the registry and the CLI read this module without vLLM installed)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from deltaserve.core.errors import InputError, require, require_choice
from deltaserve.hosts.config import HostConfig
from deltaserve.hosts.vllm.version import is_cpu_build
from deltaserve.model.loading import resolve_dtype
from deltaserve.model.lora import LoRAConfig

SCHEDULER_CLS = "deltaserve.hosts.vllm.scheduler.CoServingScheduler"
WORKER_EXTENSION_CLS = "deltaserve.hosts.vllm.worker_ext.CoServingWorkerExtension"
# The compile-safe capture model (:mod:`.aux_model`) and the Llama checkpoints it stands in for.
BASE_ARCHITECTURE = "LlamaForCausalLM"
AUX_ARCHITECTURE = "DeltaServeLlamaForCausalLM"
# vLLM accepts only these ``max_lora_rank`` values (``vllm.config.lora``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Keyword arguments DeltaServe sets itself; ``engine`` may not override them.
OWNED_KWARGS = frozenset({"scheduler_cls", "worker_extension_cls", "enable_lora",
                          "async_scheduling", "max_lora_rank", "max_loras", "dtype", "seed",
                          "num_gpu_blocks_override", "block_size", "max_num_seqs",
                          "max_num_batched_tokens", "max_model_len", "enable_prefix_caching",
                          "enforce_eager"})
CAPTURE_PATHS = ("auto", "hooks", "aux")
TRAINING_LORA_PATHS = ("auto", "direct", "vllm")


def lora_rank_for(r: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds LoRA rank ``r``."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise InputError("lora_r", r, f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")


@dataclass(frozen=True)
class VLLMHostConfig(HostConfig):
    """vLLM's own knobs. ``max_loras``: adapters per step, the reserved training adapter
    included (it is pinned to one slot). ``max_lora_rank``: the largest LoRA rank vLLM serves;
    None: the one that holds the default LoRA config's ``r``; it must hold the training
    adapter's ``r`` (checked at attach). ``block_size``: vLLM's KV block in tokens (the KV
    cache is ``kv_cache_tokens // block_size`` blocks). ``capture``: ``auto``, ``hooks`` or
    ``aux`` (see :mod:`.hooks`). ``training_lora``: ``auto``, ``direct`` or ``vllm``, who adds
    the training adapter to the training rows (see :mod:`.direct_lora`). ``enforce_eager``:
    decoder-layer hooks run only in eager mode (CPU with LoRA is eager regardless).
    ``engine``: any other ``vllm.LLM`` keyword argument."""

    enable_prefix_caching: bool = True
    max_loras: int = 2
    max_lora_rank: int | None = None
    block_size: int = 128
    capture: str = "auto"
    training_lora: str = "auto"
    enforce_eager: bool = True
    engine: Mapping[str, object] = field(default_factory=dict, metadata={"cli": False})

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice("capture", self.capture, CAPTURE_PATHS)
        require_choice("training_lora", self.training_lora, TRAINING_LORA_PATHS)
        require(self.max_loras >= 2, "max_loras", self.max_loras,
                "must be >= 2 (one slot is the training adapter's)")
        require(self.max_lora_rank is None or self.max_lora_rank in VLLM_LORA_RANKS,
                "max_lora_rank", self.max_lora_rank, f"vLLM accepts {VLLM_LORA_RANKS}")
        require(self.block_size >= 1, "block_size", self.block_size, "must be >= 1")
        require(self.kv_cache_tokens >= self.block_size, "kv_cache_tokens", self.kv_cache_tokens,
                f"must hold one block of {self.block_size} tokens")
        clash = sorted(OWNED_KWARGS & set(self.engine))
        require(not clash, "engine", clash, "set by DeltaServe (use this config's fields)")

    @property
    def lora_rank(self) -> int:
        return self.max_lora_rank or lora_rank_for(LoRAConfig().r)


def wants_aux_model(config: VLLMHostConfig) -> bool:
    """The compile-safe capture needs vLLM to build the aux-output model: asked for, or implied
    by a compiled model (``auto`` without ``enforce_eager``; on CPU, LoRA never compiles)."""
    return config.capture == "aux" or (
        config.capture == "auto" and not config.enforce_eager and not is_cpu_build())


def vllm_dtype(config: HostConfig) -> str:
    """``auto`` resolved as every host resolves it (:func:`resolve_dtype`), named for vLLM."""
    device = "cpu" if is_cpu_build() else "cuda"
    return str(resolve_dtype(config.dtype, device)).removeprefix("torch.")


def engine_kwargs(config: VLLMHostConfig | None = None, model_limit: int | None = None
                  ) -> dict[str, object]:
    """Keyword arguments for ``vllm.LLM`` that plug DeltaServe in (``model`` excluded)::

        llm = vllm.LLM(model=path, **engine_kwargs(VLLMHostConfig(max_loras=2)))

    ``model_limit``: the model's own context limit, to size ``max_model_len`` as every host
    does (:meth:`HostConfig.model_len`); without it an unset ``max_model_len`` is vLLM's
    choice."""
    c = config or VLLMHostConfig()
    extra = dict(c.engine)
    if wants_aux_model(c):
        overrides = extra.get("hf_overrides")
        extra["hf_overrides"] = {**(overrides if isinstance(overrides, Mapping) else {}),
                                 "architectures": [AUX_ARCHITECTURE]}
    max_model_len = c.model_len(model_limit) if model_limit is not None else c.max_model_len
    return dict(
        dtype=vllm_dtype(c), max_num_seqs=c.max_num_seqs,
        max_num_batched_tokens=c.max_num_batched_tokens, max_model_len=max_model_len,
        enable_prefix_caching=c.enable_prefix_caching, enable_lora=True, max_loras=c.max_loras,
        max_lora_rank=c.lora_rank, block_size=c.block_size,
        num_gpu_blocks_override=c.kv_cache_tokens // c.block_size, seed=c.seed,
        enforce_eager=c.enforce_eager, async_scheduling=False, scheduler_cls=SCHEDULER_CLS,
        worker_extension_cls=WORKER_EXTENSION_CLS, **extra)
