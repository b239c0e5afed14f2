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

from deltaserve.hosts.fused_weights import fused_llama_weights, linear_weight
from deltaserve.model.config import ModelConfig
from deltaserve.model.llama import BaseWeights
from deltaserve.model.loading import load_weights


def views_available(model: nn.Module) -> bool:
    """Whether the loaded model still holds plain weight tensors to view (not on CPU)."""
    layer = model.model.layers[0]
    return all(linear_weight(m).numel() > 0 and linear_weight(m).dim() == 2
               for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj))


def weights_from_vllm(model: nn.Module, config: ModelConfig) -> BaseWeights:
    """Views of a vLLM Llama-family model's weights as :class:`BaseWeights` (no copy)."""
    if not views_available(model):
        raise ValueError("vLLM's linear weights were repacked after loading (CPU); load the "
                         "backward's weights from the model directory instead")
    return fused_llama_weights(model, config)


def backward_weights(model: nn.Module, config: ModelConfig, model_dir: str, dtype: torch.dtype
                     ) -> BaseWeights:
    """Views of vLLM's weights where they exist (GPU), else a fresh load from ``model_dir``."""
    if views_available(model):
        return weights_from_vllm(model, config)
    return load_weights(model_dir, dtype, "cpu")[1]
