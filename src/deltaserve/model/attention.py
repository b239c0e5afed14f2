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


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (True: attend) as SDPA turns it into an additive one: 0 where
    True, -inf elsewhere, in ``dtype``. Built once per step, it spares every layer's attention
    call that conversion (three ops a layer, every layer)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf"))


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """One query token per sequence over its gathered context: q [B, Hq, D], keys/values
    [B, L, Hkv, D], ``mask`` [B, 1, 1, L] (boolean, True where a key is real, or
    :func:`additive_mask`'s form of it in q's dtype) → [B, Hq·D].

    Grouped heads ride as query rows: query head ``h`` reads KV head ``h // (Hq/Hkv)`` (SDPA's
    own GQA layout), so q viewed as [B, Hkv, Hq/Hkv, D] is one attention per KV head whose
    queries are its group, and the mask broadcasts over the group. No KV head is repeated
    (``enable_gqa`` with a mask runs CUDA's math kernel, which repeats them Hq/Hkv-fold), and
    with heads matching a masked call may take CUDA's memory-efficient kernel. On a 2-core CPU
    (``results/2026-12-07-cpu-decode-attention/``) the Llama-3-8B shape's decode attention ran
    1.3-2.7x faster than the ``enable_gqa`` call; SmolLM2's (9 heads over 3) 1.3x in fp32 and
    3 % slower in bf16. Unmeasured on a GPU."""
    b, hq, d = q.shape
    hkv = keys.shape[2]
    out = F.scaled_dot_product_attention(q.view(b, hkv, hq // hkv, d), keys.transpose(1, 2),
                                         values.transpose(1, 2), attn_mask=mask)
    return out.reshape(b, hq * d)


class PaddedSegments:
    """Independent sequences laid end to end (``lengths`` rows each), as one right-padded batch
    ``[S, L]`` (``L`` the longest): ``gather[s, j]`` is the row at position ``j`` of sequence
    ``s`` (padding repeats the sequence's last row), ``valid`` the flat index of every real row
    in that batch, in row order. Built once (host work, one copy to the device), read by every
    layer, so attention over all the sequences is one call with no per-sequence loop.

    Padding is exact under a causal mask: a real query at position ``j < n`` sees only keys at
    ``≤ j``, never a padded one, and padded queries' outputs are dropped (so no gradient flows
    through them). It costs ``S·L²`` instead of ``Σn²`` attention work: admission adds samples
    shortest first, so a step's lengths are close."""

    def __init__(self, lengths: list[int] | tuple[int, ...], device: torch.device | str,
                 starts: list[int] | tuple[int, ...] | None = None):
        """``starts``: each sequence's first row (default: end to end from row 0)."""
        n = torch.tensor(lengths, dtype=torch.long)
        first = torch.cumsum(n, 0) - n if starts is None else torch.tensor(starts,
                                                                           dtype=torch.long)
        width = int(n.max())
        pos = torch.arange(width)
        gather = first[:, None] + torch.minimum(pos[None, :], n[:, None] - 1)
        valid = (pos[None, :] < n[:, None]).reshape(-1).nonzero().squeeze(1)
        self.gather = gather.to(device)
        self.valid = valid.to(device)
        self.rows = gather.reshape(-1)[valid].to(device)  # each real row's row, in order
        self.num_segments = len(lengths)


def segments_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       segments: PaddedSegments) -> torch.Tensor:
    """Each sequence of ``segments`` attends causally to itself only, in one SDPA call: q/k/v
    [T, H, D] (the rows ``segments`` index) → [Σn, Hq·D], in ``segments.rows`` order."""
    idx = segments.gather
    out = F.scaled_dot_product_attention(
        q[idx].transpose(1, 2), k[idx].transpose(1, 2), v[idx].transpose(1, 2), is_causal=True,
        enable_gqa=q.shape[1] != k.shape[1])  # [S, Hq, L, D]
    flat = out.transpose(1, 2).reshape(idx.numel(), -1)
    return flat.index_select(0, segments.valid)


class CausalSegments:
    """Independent sequences laid end to end, each attending causally to itself only (the
    layout of training rows, and of a packed prefill with no cache): one attention call per
    layer over the padded batch (:class:`PaddedSegments`), built here, before any layer, on
    the ``device`` the forward runs on."""

    def __init__(self, lengths: list[int] | tuple[int, ...], device: torch.device | str = "cpu"):
        self.lengths = tuple(int(n) for n in lengths)
        self._padded = PaddedSegments(self.lengths, device) if len(self.lengths) > 1 else None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> torch.Tensor:
        if self._padded is None:
            return causal_attention(q, k, v)
        return segments_attention(q, k, v, self._padded)
