"""The reserved training adapter: its vLLM name and id, which no client can use, and loading it
into a pinned LoRA slot.

vLLM loads LoRA weights only from a PEFT directory, so reserving writes the adapter there once
and loads it as an ordinary LoRA; the slot is pinned (LRU eviction never drops it) and from then
on the co-server's weights are written into it in place (:mod:`.publish`).
"""

from __future__ import annotations

import shutil
import tempfile

from vllm.config import VllmConfig
from vllm.lora.request import LoRARequest
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from deltaserve.core.errors import InputError
from deltaserve.hosts.base import RESERVED_ADAPTER_PREFIX
from deltaserve.hosts.vllm.config import lora_rank_for
from deltaserve.hosts.vllm.link import EngineLink
from deltaserve.hosts.vllm.publish import AdapterPublisher
from deltaserve.model.lora import AdapterWeights, LoRAConfig
from deltaserve.model.peft_io import save_adapter

TRAIN_ADAPTER_NAME = f"{RESERVED_ADAPTER_PREFIX}train"
# vLLM's LoRA id of the training adapter: one that no vLLM API server hands out. vLLM 0.32's
# OpenAI server numbers every adapter it loads (--lora-modules, /v1/load_lora_adapter, LoRA
# resolvers) from one counter that starts at 0 and adds 1 before each load
# (OpenAIServingModels.lora_id_counter), so it issues 1, 2, 3, ...; ids live in int64 arrays
# (InputBatch.request_lora_mapping), and LoRARequest rejects ids below 1. The largest int64 is
# the one id that counter would reach last, after 2**63 - 2 loads. The in-process host numbers
# its client adapters from 1 the same way.
TRAIN_ADAPTER_ID = 2**63 - 1


def names_training_adapter(lora: LoRARequest | None) -> bool:
    """Whether a request's LoRA names the training adapter, by id or by name (vLLM hashes and
    compares ``LoRARequest`` by name, so a second adapter of that name is no safer)."""
    return lora is not None and (lora.lora_int_id == TRAIN_ADAPTER_ID
                                 or lora.lora_name == TRAIN_ADAPTER_NAME)


def check_lora_fits(lora: LoRAConfig, vllm_config: VllmConfig) -> None:
    lc = vllm_config.lora_config
    if lc is None:
        raise InputError("enable_lora", False, "the training adapter needs vLLM's LoRA support")
    if lora.r > lc.max_lora_rank:
        raise InputError("lora_r", lora.r, f"exceeds vLLM's max_lora_rank={lc.max_lora_rank}; "
                         f"start vLLM with max_lora_rank={lora_rank_for(lora.r)}")


def reserve(link: EngineLink, adapter: AdapterWeights, base_model: str) -> AdapterPublisher:
    """Load ``adapter`` into vLLM as the training adapter (replacing an earlier one), pinned to
    a slot, and point ``link`` at it."""
    runner = link.runner
    if runner is None or getattr(runner, "lora_manager", None) is None:
        raise RuntimeError("vLLM's worker has no LoRA manager: start it with enable_lora=True "
                           "and install DeltaServe's hooks first")
    check_lora_fits(adapter.config, runner.vllm_config)
    path = tempfile.mkdtemp(prefix="deltaserve-train-adapter-")
    try:
        save_adapter(path, adapter, base_model)
        _load_pinned(runner, LoRARequest(TRAIN_ADAPTER_NAME, TRAIN_ADAPTER_ID, path))
    finally:  # loaded (and pinned: never reloaded from disk); the files are not needed
        shutil.rmtree(path, ignore_errors=True)
    link.train_lora = LoRARequest(TRAIN_ADAPTER_NAME, TRAIN_ADAPTER_ID, path)
    link.publisher = AdapterPublisher(runner, TRAIN_ADAPTER_ID, adapter.config)
    return link.publisher


def _load_pinned(runner: GPUModelRunner, request: LoRARequest) -> None:
    if request.lora_int_id in runner.list_loras():
        runner.remove_lora(request.lora_int_id)
    if not runner.add_lora(request):
        raise RuntimeError(f"vLLM refused to load the training adapter from {request.lora_path}")
    runner.pin_lora(request.lora_int_id)
