"""Paged KV cache and the attention of one mixed step.

Row layout of a step: decode rows, then prefill-chunk rows, then training rows. Inference rows
write their K/V into the cache; decodes attend over their cached context (gathered by block
table, padded to the longest); a prefill chunk attends causally over its cached prefix and
itself; training rows attend only among themselves (they never touch the cache).

Everything a layer's attention indexes with is built once per step (:class:`StepAttentionMeta`):
nothing reads a device value back to the host or copies one in. A layer makes one attention
call per decode group, one per prefill chunk, and one for all the training samples together.
Prefill chunks stay one call each: prompts' lengths differ widely, and padding them to the
longest would cost S·L² where the latency model prices Σn²; a step's samples, admitted shortest
first, are close in length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltaserve.model.attention import (
    PaddedSegments,
    causal_attention,
    decode_attention,
    segments_attention,
)
from deltaserve.model.config import ModelConfig


class KVCache:
    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    def layer_flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_slots, Hkv, D] views of one layer."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of whole blocks: ``blocks`` [..., n] → [..., n·block_size, Hkv, D].
        Copying blocks, not slots, moves contiguous runs of block_size × Hkv × D values."""
        k, v = self.k[layer][blocks], self.v[layer][blocks]
        shape = (*blocks.shape[:-1], blocks.shape[-1] * self.block_size, *k.shape[-2:])
        return k.reshape(shape), v.reshape(shape)


@dataclass(frozen=True)
class PrefillChunk:
    """A prompt's chunk; behind ``prefix_len`` cached tokens, it reads them through
    ``context_blocks`` under ``mask`` (a first chunk, ``prefix_len`` 0, needs neither)."""

    rows: slice  # rows of the step
    prefix_len: int  # tokens already in the cache before this chunk
    context_blocks: torch.Tensor | None  # cache blocks holding positions [0, prefix_len + chunk)
    mask: torch.Tensor | None  # [chunk, prefix_len + chunk]: True where a row may attend


@dataclass(frozen=True)
class DecodeGroup:
    """Decodes of similar context length, attended in one padded batch."""

    rows: torch.Tensor  # [g] rows of the step
    blocks: torch.Tensor  # [g, n] block tables, padded
    mask: torch.Tensor  # [g, 1, 1, n·block_size] additive: 0 at real positions, else -inf


@dataclass(frozen=True)
class StepAttentionMeta:
    num_inference_rows: int
    slot_mapping: torch.Tensor  # [num_inference_rows] cache slot of each inference row
    decodes: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillChunk, ...]
    training: PaddedSegments | None  # training samples (rows after the inference rows)


class PagedAttention:
    """An :class:`~deltaserve.model.attention.AttentionImpl` over the paged cache."""

    def __init__(self, cache: KVCache, meta: StepAttentionMeta):
        self.cache = cache
        self.meta = meta

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> torch.Tensor:
        m = self.meta
        n_inf = m.num_inference_rows
        kc, vc = self.cache.layer_flat(layer)
        if n_inf:
            kc.index_copy_(0, m.slot_mapping, k[:n_inf])
            vc.index_copy_(0, m.slot_mapping, v[:n_inf])
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for g in m.decodes:
            keys, vals = self.cache.gather(layer, g.blocks)  # [g, L, Hkv, D]
            out[g.rows] = decode_attention(q[g.rows], keys, vals, g.mask)
        for chunk in m.prefills:
            if chunk.mask is None or chunk.context_blocks is None:
                out[chunk.rows] = causal_attention(q[chunk.rows], k[chunk.rows], v[chunk.rows])
                continue
            n, total = chunk.mask.shape
            keys, vals = self.cache.gather(layer, chunk.context_blocks)
            o = F.scaled_dot_product_attention(
                q[chunk.rows].transpose(0, 1).unsqueeze(0),
                keys[:total].transpose(0, 1).unsqueeze(0),
                vals[:total].transpose(0, 1).unsqueeze(0), attn_mask=chunk.mask,
                enable_gqa=q.shape[1] != k.shape[1])
            out[chunk.rows] = o.squeeze(0).transpose(0, 1).reshape(n, -1)
        if m.training is not None:
            out.index_copy_(0, m.training.rows, segments_attention(q, k, v, m.training))
        return out
