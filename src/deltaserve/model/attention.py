"""Attention over a flat token batch. The model calls an :class:`AttentionImpl`; a host supplies
one that reads and writes its KV cache, training uses :class:`CausalSegments`."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionImpl(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> torch.Tensor:
        """``q``: [T, Hq, D], ``k``/``v``: [T, Hkv, D] (rotary applied). Returns [T, Hq·D]."""
        ...


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """One sequence, causal: q/k/v [n, H, D] with GQA → [n, Hq·D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), is_causal=q.shape[0] > 1, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1).reshape(q.shape[0], -1)


class CausalSegments:
    """Independent sequences laid end to end, each attending causally to itself only (the
    layout of training rows, and of a packed prefill with no cache)."""

    def __init__(self, lengths: list[int] | tuple[int, ...]):
        self.lengths = tuple(int(n) for n in lengths)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> torch.Tensor:
        if len(self.lengths) == 1:
            return causal_attention(q, k, v)
        outs, start = [], 0
        for n in self.lengths:
            outs.append(causal_attention(q[start:start + n], k[start:start + n],
                                         v[start:start + n]))
            start += n
        return torch.cat(outs)
