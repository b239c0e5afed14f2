"""Attention over a flat token batch. The model calls an :class:`AttentionImpl`; a host supplies
one that reads and writes its KV cache, training uses :class:`CausalSegments`.

Which SDPA kernels run is a stated policy (:func:`sdpa_backends`), applied by
:func:`attention_kernels` around each engine step, graph capture, training forward and backward
job, never as a global setting at import."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# On CUDA: flash where it applies (no mask; grouped KV heads included), memory-efficient where
# a mask is given and the heads match, math for what neither takes (a mask with grouped KV
# heads: flash takes no mask, memory-efficient no GQA). Never cuDNN: torch ranks it first on
# Hopper, and it builds an execution plan for every new shape, up to seconds per new prefill
# length (measured on an H200, torch 2.11: shared data h200/README.md); the others build none.
CUDA_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.MATH)


def sdpa_backends(device: torch.device | str) -> tuple[SDPBackend, ...] | None:
    """The SDPA kernels attention may use on ``device``; ``None``: torch's own choice (the CPU,
    and any other device, keep their default)."""
    return CUDA_SDPA_BACKENDS if torch.device(device).type == "cuda" else None


def attention_kernels(device: torch.device | str) -> AbstractContextManager[None]:
    """A scope in which SDPA on ``device`` follows :func:`sdpa_backends`. Torch keeps these
    flags process-wide: the scope sets them and restores them on exit, so enter it once per
    step or job (from the thread that runs it), not per attention call."""
    backends = sdpa_backends(device)
    return nullcontext() if backends is None else sdpa_kernel(list(backends))


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
