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

import torch

from deltaserve.model.config import ModelConfig
from deltaserve.model.llama import BaseWeights, LayerWeights


def _w(module: Any) -> torch.Tensor:
    """The weight of a (possibly LoRA-wrapped) SGLang linear layer (same storage)."""
    return getattr(module, "base_layer", module).weight.detach()


def _cut(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    out, start = [], 0
    for n in sizes:
        out.append(t.narrow(0, start, n))
        start += n
    return out


def weights_from_sglang(model: Any, config: ModelConfig) -> BaseWeights:
    """Views of an SGLang Llama-family model's weights as :class:`BaseWeights`."""
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(getattr(attn.qkv_proj, "base_layer", attn.qkv_proj), "bias", None) \
                is not None:
            raise ValueError("projection biases: DeltaServe's SGLang host supports Llama "
                             "layers without them")
        wq, wk, wv = _cut(_w(attn.qkv_proj), [q, kv, kv])
        gate, up = _cut(_w(mlp.gate_up_proj), [inter, inter])
        layers.append(LayerWeights(
            input_norm=layer.input_layernorm.weight.detach(), q=wq, k=wk, v=wv,
            o=_w(attn.o_proj), post_norm=layer.post_attention_layernorm.weight.detach(),
            gate=gate, up=up, down=_w(mlp.down_proj)))
    vocab = config.vocab_size
    embed = model.model.embed_tokens.weight.detach()[:vocab]  # SGLang may pad the vocabulary
    lm_head = embed if config.tie_word_embeddings else model.lm_head.weight.detach()[:vocab]
    return BaseWeights(embed, layers, model.model.norm.weight.detach(), lm_head)
