"""The backward's base weights: views of the weights SGLang loaded, no copy.

SGLang fuses projections as it loads them: ``qkv_proj.weight`` is ``[q | k | v]`` stacked on
the output dimension and ``gate_up_proj.weight`` is ``[gate | up]``; ``Tensor.narrow`` cuts
them into plain views. With LoRA on, each projection is wrapped (``base_layer`` holds the
linear layer). On the CPU path (``torch_native``) SGLang keeps every weight as loaded, so the
backward process maps SGLang's own storage (moved to shared memory when the backward starts).
Tensor parallelism 1 and unquantized weights only.
"""

from __future__ import annotations

from typing import Any

from deltaserve.hosts.fused_weights import fused_llama_weights, linear_bias
from deltaserve.model.config import ModelConfig
from deltaserve.model.llama import BaseWeights


def weights_from_sglang(model: Any, config: ModelConfig) -> BaseWeights:
    """Views of an SGLang Llama-family model's weights as :class:`BaseWeights`."""
    if linear_bias(model.model.layers[0].self_attn.qkv_proj) is not None:
        raise ValueError("projection biases: DeltaServe's SGLang host supports Llama "
                         "layers without them")
    return fused_llama_weights(model, config)
