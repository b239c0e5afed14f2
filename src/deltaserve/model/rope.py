"""Rotary position embeddings, with Llama-3 frequency scaling (as Hugging Face computes them)."""

from __future__ import annotations

import math

import torch

from deltaserve.model.config import ModelConfig


def inv_frequencies(config: ModelConfig) -> torch.Tensor:
    r = config.rope
    dim = config.head_dim
    inv = 1.0 / (r.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if r.rope_type != "llama3":
        return inv
    low_wavelen = r.original_max_position_embeddings / r.low_freq_factor
    high_wavelen = r.original_max_position_embeddings / r.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / r.factor, inv)
    smooth = (r.original_max_position_embeddings / wavelen - r.low_freq_factor) / (
        r.high_freq_factor - r.low_freq_factor)
    smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary:
    """cos/sin tables per position; computed in fp32 and cast to the activations' dtype."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu"):
        self.inv_freq = inv_frequencies(config).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, 1, head_dim] each: shaped once per step to broadcast over every layer's
        heads (not reshaped per layer and per q and k)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: [tokens, heads, head_dim]; ``cos``/``sin``: [tokens, 1, head_dim]
    (:meth:`Rotary.cos_sin`)."""
    return x * cos + _rotate_half(x) * sin
