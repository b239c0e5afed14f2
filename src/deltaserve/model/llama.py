"""The Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, LoRA on any
projection. Weights are plain tensors (possibly views into another engine's fused tensors or
shared memory); the model is a function of them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F

from deltaserve.model.attention import AttentionImpl
from deltaserve.model.config import ModelConfig
from deltaserve.model.lora import LoRAGroup, apply_lora
from deltaserve.model.lora_slots import SlotLoRA
from deltaserve.model.rope import Rotary, apply_rotary

LayerHook = Callable[[int, torch.Tensor], None]
MlpHook = Callable[[int, torch.Tensor, torch.Tensor], None]
MlpSaved = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None


@dataclass
class BaseWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor  # the same tensor as ``embed`` when embeddings are tied

    def tensors(self) -> Iterator[torch.Tensor]:
        yield self.embed
        for lw in self.layers:
            for f in fields(lw):
                t = getattr(lw, f.name)
                if t is not None:
                    yield t
        yield self.norm
        if self.lm_head is not self.embed:
            yield self.lm_head

    def share_memory_(self) -> BaseWeights:
        for t in self.tensors():
            t.share_memory_()
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device


@dataclass
class ForwardContext:
    """Everything about a batch the layers need besides its hidden states."""

    positions: torch.Tensor  # [T]
    attention: AttentionImpl
    lora: tuple[LoRAGroup, ...] = ()
    slot_lora: SlotLoRA | None = None  # adapters in static slots, by row (graph decodes)
    mlp_hook: MlpHook | None = None  # sees each layer's base gate/up outputs (capture)
    mlp_saved: MlpSaved | None = None  # supplies them instead of recomputing (backward)
    _cos_sin: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)


class _Precomputed(torch.autograd.Function):
    """``x @ weight.T`` whose value was saved in the forward: skips the matmul, keeps the
    gradient to ``x`` (the frozen weight gets none)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return saved.to(x.dtype).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return grad @ weight.to(grad.dtype), None, None


def _lora(y: torch.Tensor, x: torch.Tensor, ctx: ForwardContext, layer: int, module: str
          ) -> torch.Tensor:
    """``y`` (a projection's base output on ``x``) plus the batch's LoRA updates."""
    if ctx.lora:
        y = apply_lora(y, x, ctx.lora, layer, module)
    if ctx.slot_lora is not None:
        y = ctx.slot_lora.apply(y, x, layer, module)
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: BaseWeights):
        self.config = config
        self.weights = weights
        self.rotary = Rotary(config, weights.device)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weights.embed)

    def _proj(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
              ctx: ForwardContext, layer: int, module: str) -> torch.Tensor:
        return _lora(F.linear(x, w, bias), x, ctx, layer, module)

    def layer(self, i: int, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Decoder layer ``i`` on residual stream ``h`` [T, hidden] → its output."""
        c, w = self.config, self.weights.layers[i]
        if ctx._cos_sin is None:
            ctx._cos_sin = self.rotary.cos_sin(ctx.positions, h.dtype)
        cos, sin = ctx._cos_sin
        t = h.shape[0]
        x = rms_norm(h, w.input_norm, c.rms_norm_eps)
        q = self._proj(x, w.q, w.q_bias, ctx, i, "q_proj").view(t, c.num_heads, c.head_dim)
        k = self._proj(x, w.k, w.k_bias, ctx, i, "k_proj").view(t, c.num_kv_heads, c.head_dim)
        v = self._proj(x, w.v, w.v_bias, ctx, i, "v_proj").view(t, c.num_kv_heads, c.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = ctx.attention(i, q, k, v)
        h = h + self._proj(attn, w.o, None, ctx, i, "o_proj")
        x = rms_norm(h, w.post_norm, c.rms_norm_eps)
        if ctx.mlp_saved is not None:
            saved_gate, saved_up = ctx.mlp_saved(i)
            gate = _Precomputed.apply(x, w.gate, saved_gate)
            up = _Precomputed.apply(x, w.up, saved_up)
        else:
            gate, up = F.linear(x, w.gate), F.linear(x, w.up)
            if ctx.mlp_hook is not None:
                ctx.mlp_hook(i, gate, up)
        gate = _lora(gate, x, ctx, i, "gate_proj")
        up = _lora(up, x, ctx, i, "up_proj")
        return h + self._proj(F.silu(gate) * up, w.down, None, ctx, i, "down_proj")

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext,
                hook: LayerHook | None = None) -> torch.Tensor:
        """Embeddings through every layer; ``hook(i, h)`` sees each layer's input first (it may
        raise to stop the step). Returns the final residual stream (before the last norm)."""
        h = self.embed(input_ids)
        for i in range(self.num_layers):
            if hook is not None:
                hook(i, h)
            h = self.layer(i, h, ctx)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head, in fp32."""
        x = rms_norm(h, self.weights.norm, self.config.rms_norm_eps)
        return F.linear(x, self.weights.lm_head).float()
