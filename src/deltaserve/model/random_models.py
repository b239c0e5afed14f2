"""Paper-shaped models with random weights, for timing: ``random:llama-3-8b`` and friends.

A step's time depends on the architecture's shapes, not on the weights' values, so a model of
the published shape with random weights times exactly like the real one, without a 16 GB
download. The weights are drawn on the target device from the seed, in the model's dtype: no
file and no CPU copy. Their outputs are noise: these models are for latency and throughput,
never for accuracy. The tokenizer is the built-in model's (its ids fit every vocabulary here).
"""

from __future__ import annotations

import torch

from deltaserve.core.errors import InputError
from deltaserve.core.jsontypes import JsonObject
from deltaserve.model.config import ModelConfig, RopeConfig
from deltaserve.model.llama import BaseWeights, LayerWeights

RANDOM_PREFIX = "random:"
INIT_STD = 0.02  # the Llama configs' ``initializer_range``

RANDOM_MODELS: dict[str, ModelConfig] = {
    # meta-llama/Meta-Llama-3-8B, config.json: hidden 4096, 32 layers, 32 heads, 8 KV heads,
    # intermediate 14336, vocab 128256, rope_theta 500000, rms_norm_eps 1e-5, 8192 positions,
    # untied embeddings. The model of the paper's A100 experiments.
    "llama-3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=500000.0), max_position_embeddings=8192),
    # meta-llama/Llama-3.2-1B, config.json: hidden 2048, 16 layers, 32 heads, 8 KV heads (head
    # dim 64), intermediate 8192, vocab 128256, rope_theta 500000 with llama3 scaling (factor
    # 32, low 1, high 4, original 8192 positions), 131072 positions, tied embeddings.
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position_embeddings=8192),
        max_position_embeddings=131072, tie_word_embeddings=True),
    # A CPU test shape: two small layers; the vocabulary is SmolLM2's 49152, so the built-in
    # tokenizer's ids fit.
    "tiny": ModelConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=8192, tie_word_embeddings=True),
}


def is_random(name: str) -> bool:
    return name.startswith(RANDOM_PREFIX)


def random_config(name: str) -> ModelConfig:
    """The architecture of ``random:<shape>``; an unknown shape is an input error listing the
    choices."""
    shape = name.removeprefix(RANDOM_PREFIX)
    if not is_random(name) or shape not in RANDOM_MODELS:
        choices = ", ".join(RANDOM_PREFIX + k for k in RANDOM_MODELS)
        raise InputError("model", name, f"unknown random model; choose from {choices}")
    return RANDOM_MODELS[shape]


def hf_config(config: ModelConfig, name: str) -> JsonObject:
    """``config`` as a Hugging Face Llama ``config.json`` (read back by
    :meth:`ModelConfig.from_hf`, and by transformers for a model built from the config)."""
    rope = config.rope
    scaling = None if rope.rope_type == "default" else {
        "rope_type": rope.rope_type, "factor": rope.factor,
        "low_freq_factor": rope.low_freq_factor, "high_freq_factor": rope.high_freq_factor,
        "original_max_position_embeddings": rope.original_max_position_embeddings}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "_name_or_path": name,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "hidden_act": "silu", "rms_norm_eps": config.rms_norm_eps, "rope_theta": rope.theta,
        "rope_scaling": scaling, "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": False,
        "initializer_range": INIT_STD,
    }


def random_weights(config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                   seed: int = 0) -> BaseWeights:
    """Weights of ``config`` drawn from N(0, 0.02²) on ``device`` in ``dtype`` by a generator on
    that device (norms are ones): the same seed gives the same weights on one device."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        t = torch.empty(*shape, dtype=dtype, device=device)
        return t.normal_(0.0, INIT_STD, generator=gen)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype, device=device)

    h, i, q, kv = (config.hidden_size, config.intermediate_size, config.q_size,
                   config.kv_size)
    layers = [LayerWeights(input_norm=ones(h), q=draw(q, h), k=draw(kv, h), v=draw(kv, h),
                           o=draw(h, q), post_norm=ones(h), gate=draw(i, h), up=draw(i, h),
                           down=draw(h, i))
              for _ in range(config.num_layers)]
    embed = draw(config.vocab_size, h)
    lm_head = embed if config.tie_word_embeddings else draw(config.vocab_size, h)
    return BaseWeights(embed, layers, ones(h), lm_head)
