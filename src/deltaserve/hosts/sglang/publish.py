"""Writing the trained adapter into SGLang's reserved LoRA slot, in place.

SGLang 0.5.23 keeps every loaded adapter twice (``sglang/srt/lora/``):

* a host copy, ``LoRAManager.loras[lora_id]`` (a ``LoRAAdapter``), whose per-layer ``weights``
  dict SGLang refills the device slot from whenever the adapter is (re)loaded into the pool
  after an eviction; projections are stacked as the model stacks them: ``qkv_proj`` holds
  ``A = [q; k; v]`` (``3r × in``) and ``B = [q; k; v]`` (``(q+k+v) × r``), ``gate_up_proj``
  holds ``[gate; up]``; ``o_proj`` and ``down_proj`` one each. ``B`` is stored as PEFT stores
  it: SGLang applies ``scaling = alpha / r`` at run time (the backend's per-adapter scalings).
* for resident adapters, a slot of the memory pool (``LoRAMemoryPool``): per layer and module,
  ``A_buffer[module][layer][slot, :c·r, :]`` and ``B_buffer[module][layer][slot, :, :r]``
  (``c`` the number of stacked projections; the buffers are sized for ``max_lora_rank``).
  ``uid_to_buffer_id[lora_id]`` is the slot.

A publish overwrites both in place (the forward keeps reading the same storage), and drops
SGLang's pinned staging copies of the host weights (``layer.pinned_weights``, used only with
overlapped LoRA loading on GPU), so a later re-slotting can never restore stale weights. The
reserved adapter is loaded pinned (``pinned=True``) and slotted when its publisher is created,
so SGLang never evicts it. Publishing runs
in the scheduler's thread between steps.
"""

from __future__ import annotations

from typing import Any

import torch

from deltaserve.core.errors import InputError
from deltaserve.model.lora import AdapterWeights

# SGLang module (under ``model.layers.{i}.``) → the Hugging Face projections stacked in it.
STACKED: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("self_attn", "o_proj", ("o_proj",)),
    ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp", "down_proj", ("down_proj",)),
)


def _key(layer: int, block: str, module: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.{block}.{module}.lora_{which}.weight"


def _targets(targets: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    """Whether an adapter with ``targets`` covers the stacked module of ``parts`` (all or none:
    DeltaServe publishes whole stacks)."""
    hit = [p in targets for p in parts]
    if any(hit) and not all(hit):
        raise InputError("target_modules", targets, f"SGLang stacks {', '.join(parts)} into one "
                         "LoRA module; target all of them or none")
    return all(hit)


class AdapterPublisher:
    """Publishes :class:`AdapterWeights` into SGLang adapter ``lora_id``'s host copy and slot."""

    def __init__(self, lora_manager: Any, lora_id: str):
        self.manager = lora_manager
        self.lora_id = lora_id
        self.num_publishes = 0
        if lora_id not in lora_manager.loras:
            raise RuntimeError(f"SGLang has no adapter {lora_id!r} loaded")
        # SGLang slots adapters lazily, at the first batch that uses them; the reserved one is
        # slotted now (LoRAManager.fetch_new_loras) and, loaded pinned, never evicted
        lora_manager.fetch_new_loras({lora_id})

    @property
    def slot(self) -> int | None:
        """The memory-pool slot holding the adapter (None while it is not resident)."""
        return self.manager.memory_pool.uid_to_buffer_id.get(self.lora_id)

    def publish(self, adapter: AdapterWeights) -> None:
        host = self.manager.loras[self.lora_id]
        r = adapter.config.r
        if r != host.config.r:
            raise ValueError(f"adapter rank {r} != the reserved SGLang adapter's {host.config.r}")
        pool, slot = self.manager.memory_pool, self.slot
        with torch.no_grad():
            for layer in range(adapter.model_config.num_layers):
                weights = host.layers[layer].weights
                for block, module, parts in STACKED:
                    if not _targets(adapter.config.target_modules, parts):
                        continue
                    a = torch.cat([adapter.a(layer, p) for p in parts])  # (c·r) × in
                    b = torch.cat([adapter.b(layer, p) for p in parts])  # Σout × r
                    weights[_key(layer, block, module, "A")].copy_(a)
                    weights[_key(layer, block, module, "B")].copy_(b)
                    if slot is not None:
                        pool.A_buffer[module][layer][slot, : a.shape[0]].copy_(a)
                        pool.B_buffer[module][layer][slot, :, :r].copy_(b)
                getattr(host.layers[layer], "pinned_weights", {}).clear()
        self.num_publishes += 1

    def read(self, model_config: Any, lora_config: Any) -> AdapterWeights:
        """The slot's current weights as :class:`AdapterWeights`: for checking that a publish
        landed in the buffers the forward reads."""
        out = AdapterWeights(model_config, lora_config)
        pool, slot, r = self.manager.memory_pool, self.slot, lora_config.r
        if slot is None:
            raise RuntimeError(f"adapter {self.lora_id!r} holds no slot")
        with torch.no_grad():
            for layer in range(model_config.num_layers):
                for _, module, parts in STACKED:
                    if not _targets(lora_config.target_modules, parts):
                        continue
                    a_rows = pool.A_buffer[module][layer][slot]
                    b_cols = pool.B_buffer[module][layer][slot]
                    a_off = b_off = 0
                    for p in parts:
                        a, b = out.a(layer, p), out.b(layer, p)
                        a.copy_(a_rows[a_off: a_off + r])
                        b.copy_(b_cols[b_off: b_off + b.shape[0], :r])
                        a_off += r
                        b_off += b.shape[0]
        return out
