"""Views of an engine's fused Llama weights as the backward's :class:`BaseWeights`, no copy.

vLLM and SGLang both fuse projections as they load a Llama-family model: ``qkv_proj.weight`` is
``[q | k | v]`` stacked on the output dimension and ``gate_up_proj.weight`` is ``[gate | up]``,
and with LoRA on each projection is wrapped (``base_layer`` holds the linear layer). Both may pad
the vocabulary of the embedding and LM head. ``Tensor.narrow`` cuts the fused tensors into plain
views, so the backward maps the engine's own storage.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.model.config import ModelConfig
from deltaserve.model.llama import BaseWeights, LayerWeights


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The weight of a (possibly LoRA-wrapped) engine linear layer, detached (same storage)."""
    return getattr(module, "base_layer", module).weight.detach()


def linear_bias(module: nn.Module) -> torch.Tensor | None:
    bias = getattr(getattr(module, "base_layer", module), "bias", None)
    return bias.detach() if bias is not None else None


def cut_rows(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """``t`` cut along dim 0 into views (``narrow``: each a plain view of the fused tensor)."""
    out, start = [], 0
    for n in sizes:
        out.append(t.narrow(0, start, n))
        start += n
    return out


def _layer(layer: nn.Module, config: ModelConfig) -> LayerWeights:
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    attn, mlp = layer.self_attn, layer.mlp
    wq, wk, wv = cut_rows(linear_weight(attn.qkv_proj), [q, kv, kv])
    gate, up = cut_rows(linear_weight(mlp.gate_up_proj), [inter, inter])
    qkv_bias = linear_bias(attn.qkv_proj)
    bq = bk = bv = None
    if qkv_bias is not None:
        bq, bk, bv = cut_rows(qkv_bias, [q, kv, kv])
    return LayerWeights(
        input_norm=layer.input_layernorm.weight.detach(), q=wq, k=wk, v=wv,
        o=linear_weight(attn.o_proj), post_norm=layer.post_attention_layernorm.weight.detach(),
        gate=gate, up=up, down=linear_weight(mlp.down_proj), q_bias=bq, k_bias=bk, v_bias=bv)


def fused_llama_weights(model: nn.Module, config: ModelConfig) -> BaseWeights:
    """Views of a fused Llama-family engine model's weights (tensor parallelism 1, unquantized)."""
    layers = [_layer(layer, config) for layer in model.model.layers]
    vocab = config.vocab_size
    embed = linear_weight(model.model.embed_tokens)[:vocab]  # the real rows of a padded vocab
    lm_head = embed if config.tie_word_embeddings else linear_weight(model.lm_head)[:vocab]
    return BaseWeights(embed, layers, model.model.norm.weight.detach(), lm_head)
