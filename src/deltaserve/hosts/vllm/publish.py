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
"""

from __future__ import annotations

from typing import Any

import torch

from deltaserve.model.lora import AdapterWeights

# vLLM module (under ``model.layers.{i}.``) → the Hugging Face projections packed in it.
PACKED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("self_attn.o_proj", ("o_proj",)),
    ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp.down_proj", ("down_proj",)),
)


def _as_list(x: Any) -> list[Any]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


class AdapterPublisher:
    """Publishes :class:`AdapterWeights` into the slot of vLLM adapter ``lora_id``."""

    def __init__(self, runner: Any, lora_id: int):
        self.manager = runner.lora_manager._adapter_manager  # the LRU LoRA model manager
        self.lora_id = lora_id
        self.num_publishes = 0

    @property
    def slot(self) -> int:
        ids = self.manager.lora_index_to_id
        if self.lora_id not in ids:
            raise RuntimeError(f"LoRA {self.lora_id} holds no slot: the reserved training "
                               "adapter must stay pinned")
        return ids.index(self.lora_id)

    def publish(self, adapter: AdapterWeights) -> None:
        scaling = adapter.config.scaling
        r = adapter.config.r
        slot = self.slot
        cpu = self.manager.get_adapter(self.lora_id)
        with torch.inference_mode():
            for layer in range(adapter.model_config.num_layers):
                for packed, parts in PACKED:
                    name = f"model.layers.{layer}.{packed}"
                    module = self.manager.modules[name]
                    cpu_w = cpu.get_lora(name) if cpu is not None else None
                    cpu_a = _as_list(cpu_w.lora_a) if cpu_w is not None else []
                    cpu_b = _as_list(cpu_w.lora_b) if cpu_w is not None else []
                    for s, proj in enumerate(parts):
                        if not adapter.has(proj):
                            continue
                        a = adapter.a(layer, proj)
                        b = adapter.b(layer, proj) * scaling
                        module.lora_a_stacked[s][slot, 0, :r, : a.shape[1]].copy_(a)
                        module.lora_b_stacked[s][slot, 0, : b.shape[0], :r].copy_(b)
                        if s < len(cpu_a) and cpu_a[s] is not None:
                            cpu_a[s].copy_(a)
                            cpu_b[s].copy_(b)
        self.num_publishes += 1

    def read(self, model_config: Any, lora_config: Any) -> AdapterWeights:
        """The slot's current weights as :class:`AdapterWeights` (B unscaled): for tests and
        for checking that a publish landed."""
        out = AdapterWeights(model_config, lora_config)
        slot, r, scaling = self.slot, lora_config.r, lora_config.scaling
        with torch.no_grad():
            for layer in range(model_config.num_layers):
                for packed, parts in PACKED:
                    module = self.manager.modules[f"model.layers.{layer}.{packed}"]
                    for s, proj in enumerate(parts):
                        if not out.has(proj):
                            continue
                        a, b = out.a(layer, proj), out.b(layer, proj)
                        a.copy_(module.lora_a_stacked[s][slot, 0, :r, : a.shape[1]])
                        b.copy_(module.lora_b_stacked[s][slot, 0, : b.shape[0], :r] / scaling)
        return out
