"""SGLang 0.5.23's LoRA code on a machine without a CUDA device: the ``pin_memory`` shim.

The problem: SGLang's LoRA layers and its LoRA backends put small index tensors in pinned host
memory unconditionally, through factory arguments (``torch.tensor(..., pin_memory=True)``,
``torch.zeros(..., pin_memory=True)``) and ``Tensor.pin_memory()``
(``sglang/srt/lora/layers.py``, ``sglang/srt/lora/backend/torch_backend.py``). Pinning asks the
CUDA driver for page-locked memory, so without a GPU it raises ``RuntimeError: Found no NVIDIA
driver on your system`` and an engine started with ``--enable-lora`` dies while it builds its
LoRA layers, before serving anything.

The fix: pinned memory only makes host-to-device copies asynchronous. Where no CUDA device
exists there is no device to copy to, so an ordinary allocation holds the same values and every
later use (``copy_(..., non_blocking=True)`` into a CPU tensor) is the same. :class:`NoPinMemory`
is a ``TorchFunctionMode`` that, while active, turns every pin request into an ordinary
allocation: ``pin_memory=True`` becomes ``False`` and ``Tensor.pin_memory()`` returns the tensor.

Where it acts: only inside SGLang's LoRA entry points (:data:`LORA_ENTRY_POINTS`: building the
LoRA manager and its layers, preparing each batch's LoRA indices, loading, unloading and
re-slotting adapters), entered by an ``AROUND`` hook registered in SGLang's own
``HookRegistry`` (``sglang/srt/plugins/hook_registry.py``) by DeltaServe's ``sglang.srt.plugins``
entry point (:mod:`deltaserve.hosts.sglang.plugin`), so no SGLang file changes, and nothing
outside those calls is intercepted. It is registered only when DeltaServe drives SGLang (the
plugin is inert otherwise) and ``torch.cuda.is_available()`` is False: with a CUDA device
SGLang runs untouched. When it is registered it says so once in the
log (logger ``deltaserve.sglang``, level WARNING), so a CPU run shows it. Setting
``DELTASERVE_SGLANG_PIN_SHIM=0`` turns it off (SGLang's LoRA then fails on a CUDA-less machine
as it does without DeltaServe).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from torch.overrides import TorchFunctionMode

logger = logging.getLogger("deltaserve.sglang")

# Set to "0" to keep SGLang's own behaviour on a machine without CUDA.
SHIM_ENV = "DELTASERVE_SGLANG_PIN_SHIM"

# Every SGLang 0.5.23 call that reaches a pin request on the LoRA path (the layers' __init__ and
# set_lora_info run inside the manager's __init__/update_lora_info; the backends' per-batch
# index tensors inside prepare_lora_batch).
LORA_ENTRY_POINTS: tuple[str, ...] = (
    "sglang.srt.lora.lora_manager.LoRAManager.__init__",
    "sglang.srt.lora.lora_manager.LoRAManager.prepare_lora_batch",
    "sglang.srt.lora.lora_manager.LoRAManager.fetch_new_loras",
    "sglang.srt.lora.lora_manager.LoRAManager.update_lora_info",
    "sglang.srt.lora.lora_manager.LoRAManager.load_lora_adapter",
    "sglang.srt.lora.lora_manager.LoRAManager.load_lora_adapter_from_tensors",
    "sglang.srt.lora.lora_manager.LoRAManager.unload_lora_adapter",
)


class NoPinMemory(TorchFunctionMode):
    """While active, pin requests allocate ordinary (pageable) host memory."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.pin_memory:
            return args[0]
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


def shim_needed() -> bool:
    """Whether pinning is impossible here (no CUDA device) and the shim is not switched off."""
    return os.environ.get(SHIM_ENV, "1") != "0" and not torch.cuda.is_available()


def without_pinning(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """SGLang ``AROUND`` hook: run ``original`` with pin requests made ordinary allocations."""
    with NoPinMemory():
        return original(*args, **kwargs)


def register_pin_memory_shim() -> bool:
    """Register :func:`without_pinning` on every :data:`LORA_ENTRY_POINTS` in SGLang's
    ``HookRegistry`` when :func:`shim_needed`. SGLang applies registered hooks itself right after
    its plugins ran (``load_plugins``). Returns whether the shim was registered."""
    if not shim_needed():
        return False
    for target in LORA_ENTRY_POINTS:
        HookRegistry.register(target, without_pinning, HookType.AROUND)
    logger.warning("DeltaServe: no CUDA device, so SGLang's LoRA code allocates ordinary host "
                   "memory where it asks for pinned memory (pid %d; %s=0 turns this off)",
                   os.getpid(), SHIM_ENV)
    return True
