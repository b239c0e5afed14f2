"""Base weights for the backward process, taken from the weights vLLM loaded.

vLLM fuses projections: ``qkv_proj.weight`` is ``[q | k | v]`` stacked on the output dimension
and ``gate_up_proj.weight`` is ``[gate | up]``. Cutting them with ``Tensor.narrow`` gives views,
so the backward maps vLLM's own storage with no copy (on a GPU, torch.multiprocessing then hands
the storage to the backward process by CUDA IPC). This needs tensor parallelism 1 and
unquantized weights.

On CPU, vLLM repacks every linear weight for its GEMM kernels after loading and empties
``layer.weight`` (``dispatch_cpu_unquantized_gemm(remove_weight=True)``), so there is nothing to
view: :func:`backward_weights` then loads the checkpoint again from the model directory (one more
copy of the base weights in memory).
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.model.config import ModelConfig
from deltaserve.model.llama import BaseWeights, LayerWeights
from deltaserve.model.loading import load_weights


def _w(module: nn.Module) -> torch.Tensor:
    """The weight of a (possibly LoRA-wrapped) vLLM layer, detached (same storage)."""
    return getattr(module, "base_layer", module).weight.detach()


def _rows(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """``t`` cut along dim 0 into views (``narrow``: each a plain view of the fused tensor)."""
    out, start = [], 0
    for n in sizes:
        out.append(t.narrow(0, start, n))
        start += n
    return out


def _bias(module: nn.Module) -> torch.Tensor | None:
    bias = getattr(getattr(module, "base_layer", module), "bias", None)
    return bias.detach() if bias is not None else None


def views_available(model: nn.Module) -> bool:
    """Whether the loaded model still holds plain weight tensors to view (not on CPU)."""
    layer = model.model.layers[0]
    return all(_w(m).numel() > 0 and _w(m).dim() == 2
               for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj))


def weights_from_vllm(model: nn.Module, config: ModelConfig) -> BaseWeights:
    """Views of a vLLM Llama-family model's weights as :class:`BaseWeights` (no copy)."""
    if not views_available(model):
        raise ValueError("vLLM's linear weights were repacked after loading (CPU); load the "
                         "backward's weights from the model directory instead")
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        wq, wk, wv = _rows(_w(attn.qkv_proj), [q, kv, kv])
        gate, up = _rows(_w(mlp.gate_up_proj), [inter, inter])
        qkv_bias = _bias(attn.qkv_proj)
        bq = bk = bv = None
        if qkv_bias is not None:
            bq, bk, bv = _rows(qkv_bias, [q, kv, kv])
        layers.append(LayerWeights(
            input_norm=layer.input_layernorm.weight.detach(), q=wq, k=wk, v=wv,
            o=_w(attn.o_proj), post_norm=layer.post_attention_layernorm.weight.detach(),
            gate=gate, up=up,
            down=_w(mlp.down_proj), q_bias=bq, k_bias=bk, v_bias=bv))
    vocab = config.vocab_size
    # vLLM pads the vocabulary of its embedding / LM head to a multiple of 64: view the real rows
    embed = _w(model.model.embed_tokens)[:vocab]
    lm_head = embed if config.tie_word_embeddings else _w(model.lm_head)[:vocab]
    return BaseWeights(embed, layers, model.model.norm.weight.detach(), lm_head)


def backward_weights(model: nn.Module, config: ModelConfig, model_dir: str, dtype: torch.dtype
                     ) -> BaseWeights:
    """Views of vLLM's weights where they exist (GPU), else a fresh load from ``model_dir``."""
    if views_available(model):
        return weights_from_vllm(model, config)
    return load_weights(model_dir, dtype, "cpu")[1]
