"""A differentiable Llama-family decoder with multi-LoRA batching, and its weight loading.

The same code serves inference (no grad, paged KV through a host's attention) and the backward
recompute (grad, whole sequences, layer by layer).
"""

from deltaserve.model.attention import AttentionImpl, CausalSegments
from deltaserve.model.config import ModelConfig
from deltaserve.model.llama import BaseWeights, ForwardContext, LayerWeights, LlamaModel
from deltaserve.model.lora import AdapterWeights, LoRAConfig, LoRAGroup

__all__ = [
    "AdapterWeights", "AttentionImpl", "BaseWeights", "CausalSegments", "ForwardContext",
    "LayerWeights", "LlamaModel", "LoRAConfig", "LoRAGroup", "ModelConfig",
]
