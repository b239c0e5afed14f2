"""Random-weight models of published shapes: the table against the published configs, the
weights drawn on the device from the seed, the tokenizer (SmolLM2's or the byte fallback)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from deltaserve.core.errors import InputError
from deltaserve.hosts.config import HostConfig
from deltaserve.model import loading
from deltaserve.model.byte_tokenizer import byte_tokenizer
from deltaserve.model.config import ModelConfig
from deltaserve.model.random_models import RANDOM_MODELS, hf_config, random_config, random_weights


def num_params(c: ModelConfig) -> int:
    """Parameters of a Llama of config ``c``, counted independently of the weight builder."""
    h, i = c.hidden_size, c.intermediate_size
    attn = h * c.num_heads * c.head_dim * 2 + h * c.num_kv_heads * c.head_dim * 2
    layer = attn + 3 * h * i + 2 * h
    embed = c.vocab_size * h * (1 if c.tie_word_embeddings else 2)
    return c.num_layers * layer + embed + h


def test_published_sizes():
    # the published checkpoints' parameter counts (safetensors metadata of
    # meta-llama/Meta-Llama-3-8B and meta-llama/Llama-3.2-1B)
    assert num_params(RANDOM_MODELS["llama-3-8b"]) == 8_030_261_248
    assert num_params(RANDOM_MODELS["llama-3.2-1b"]) == 1_235_814_400
    assert RANDOM_MODELS["tiny"].vocab_size >= 49152  # SmolLM2's ids fit


@pytest.mark.parametrize("name", sorted(RANDOM_MODELS))
def test_hf_config_round_trips(name):
    assert ModelConfig.from_hf(hf_config(RANDOM_MODELS[name], name)) == RANDOM_MODELS[name]


def test_unknown_name_lists_choices():
    with pytest.raises(InputError) as e:
        random_config("random:llama-9")
    assert e.value.field == "model" and "random:llama-3-8b" in e.value.reason
    with pytest.raises(InputError, match="random:tiny"):
        HostConfig(model="random:nope")  # checked when the config is built, before any load


def test_weights_are_seeded_and_shaped():
    c = RANDOM_MODELS["tiny"]
    a = random_weights(c, torch.bfloat16, "cpu", seed=1)
    b = random_weights(c, torch.bfloat16, "cpu", seed=1)
    other = random_weights(c, torch.bfloat16, "cpu", seed=2)
    assert sum(t.numel() for t in a.tensors()) == num_params(c)
    assert all(t.dtype == torch.bfloat16 for t in a.tensors())
    assert torch.equal(a.layers[1].down, b.layers[1].down)
    assert not torch.equal(a.layers[1].down, other.layers[1].down)
    assert a.lm_head is a.embed  # tied
    assert abs(float(a.embed.float().std()) - 0.02) < 0.001


def test_random_model_directory_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTASERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(loading, "load_tokenizer",
                        lambda name: (_ for _ in ()).throw(InputError("model", name, "absent")))
    path = loading.resolve_model("random:tiny")
    assert not list(path.glob("*.safetensors"))  # nothing drawn to disk
    assert json.loads((path / loading.RANDOM_MARKER).read_text())["tokenizer"] == "bytes"
    config, weights = loading.load_weights("random:tiny", torch.float32, "cpu", seed=3)
    assert config == RANDOM_MODELS["tiny"]
    assert torch.equal(weights.norm, torch.ones(config.hidden_size))


def test_byte_tokenizer_round_trips_and_fits():
    tok = byte_tokenizer()
    text = "héllo, wörld\n  ✓"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode())  # one token per byte
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert len(tok) <= min(c.vocab_size for c in RANDOM_MODELS.values())
    assert tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("name", sorted(RANDOM_MODELS))
def test_transformers_builds_the_same_architecture(name):
    """transformers reads the written config.json into a model of the same parameter count
    (on the meta device: no memory), so the standalone trainer trains the same shape."""
    hf = LlamaConfig(**{k: v for k, v in hf_config(RANDOM_MODELS[name], name).items()
                        if k not in ("architectures", "model_type", "_name_or_path")})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in model.parameters()) == num_params(RANDOM_MODELS[name])
