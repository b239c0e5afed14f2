"""The compile-safe capture path: vLLM's Llama with every decoder layer's input among its
auxiliary hidden-state outputs (vLLM's EAGLE-3 mechanism).

Python hooks inside a ``torch.compile``d model either never run or are traced once, and vLLM
traces its model once at start-up, so the layers whose residual stream the model emits must be
chosen when the model is built. :func:`register_aux_capture_model` registers this subclass in
vLLM's model registry under an architecture name of its own (from the general plugin in every
vLLM process DeltaServe drives, and by the host), and the engine selects it with vLLM's
``hf_overrides`` (``engine_kwargs`` sets it), so no other engine's Llama changes. The forward hands
vLLM the plain hidden states and keeps the auxiliary outputs on the module for the worker's hook
(:mod:`deltaserve.hosts.vllm.hooks`, ``capture="aux"``). The cost: one extra residual-stream
tensor per layer per step, kept until the next step.
"""

from __future__ import annotations

import torch
from vllm import ModelRegistry
from vllm.config import VllmConfig
from vllm.model_executor.models.llama import LlamaForCausalLM

from deltaserve.hosts.vllm.config import AUX_ARCHITECTURE


class DeltaServeLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        # layer i's input is aux index i (index 0: the embeddings), fixed before any compile
        self.set_aux_hidden_state_layers(tuple(range(self.config.num_hidden_layers)))
        self.deltaserve_aux: list[torch.Tensor] | None = None

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        out = super().forward(*args, **kwargs)
        if isinstance(out, tuple):
            out, self.deltaserve_aux = out
        return out


def register_aux_capture_model() -> None:
    """Make :data:`AUX_ARCHITECTURE` known to vLLM in this process (idempotent)."""
    if AUX_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(
            AUX_ARCHITECTURE, "deltaserve.hosts.vllm.aux_model:DeltaServeLlamaForCausalLM")
