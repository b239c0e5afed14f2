"""Logits of deltaserve.model against transformers' implementation of the same weights."""

import pytest
import torch

from deltaserve.model import CausalSegments, ForwardContext, LlamaModel
from deltaserve.model.loading import load_weights
from tests.tiny import save_tiny


def ours(path):
    config, weights = load_weights(path)
    return LlamaModel(config, weights)


def run(model, seqs, lora=()):
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    ctx = ForwardContext(pos, CausalSegments([len(s) for s in seqs]), lora)
    with torch.no_grad():
        return model.logits(model.forward(ids, ctx))


@pytest.mark.parametrize("overrides", [
    {},
    {"tie_word_embeddings": True},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
     "rope_theta": 500000.0},
    {"num_key_value_heads": 4},
])
def test_logits_match_transformers(tmp_path, overrides):
    ref = None
    path = save_tiny(tmp_path / "m", seed=1, **overrides)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = ours(path)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 97, (n,), generator=g) for n in (5, 37, 120)]
    got = run(model, seqs)
    start = 0
    for s in seqs:
        with torch.no_grad():
            want = ref(s[None]).logits[0]
        torch.testing.assert_close(got[start:start + len(s)], want, rtol=1e-4, atol=1e-5)
        start += len(s)


def test_bf16_close_to_fp32(tmp_path):
    path = save_tiny(tmp_path / "m", seed=2)
    f32 = ours(path)
    config, w16 = load_weights(path, dtype=torch.bfloat16)
    b16 = LlamaModel(config, w16)
    seq = [torch.arange(40) % 97]
    a, b = run(f32, seq), run(b16, seq)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    torch.testing.assert_close(b, a, rtol=0.05, atol=0.05)
