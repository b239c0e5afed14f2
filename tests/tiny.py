"""A tiny random Llama built in-process: the reference model of the unit tests."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
            max_position_embeddings=512, tie_word_embeddings=False)


def hf_tiny_llama(seed: int = 0, **overrides):
    """A randomly initialised transformers LlamaForCausalLM (fp32, eager-free sdpa)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY, **overrides})
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF zero-inits nothing important, but make norms non-trivial
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def save_tiny(path: Path, seed: int = 0, **overrides) -> Path:
    model = hf_tiny_llama(seed, **overrides)
    model.save_pretrained(path)
    return path
