"""Architecture of a Llama-family model, read from a Hugging Face ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.core.errors import InputError, require
from deltaserve.core.jsontypes import JsonObject

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class RopeConfig:
    """``rope_type``: ``default`` or ``llama3`` (Llama-3.1 frequency-dependent scaling)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        require(self.rope_type in ("default", "llama3"), "rope_type", self.rope_type,
                "supported RoPE types: default, llama3")
        require(self.theta > 0, "rope_theta", self.theta, "must be > 0")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "llama"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            require(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads", self.num_kv_heads,
                f"must divide num_heads={self.num_heads}")
        require(self.model_type in SUPPORTED_MODEL_TYPES, "model_type", self.model_type,
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def module_dims(self, module: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of a projection, by its Hugging Face name."""
        h, i = self.hidden_size, self.intermediate_size
        dims = {"q_proj": (h, self.q_size), "k_proj": (h, self.kv_size),
                "v_proj": (h, self.kv_size), "o_proj": (self.q_size, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        if module not in dims:
            raise InputError("target_modules", module, f"unknown module; known: {sorted(dims)}")
        return dims[module]

    @classmethod
    def from_hf(cls, cfg: JsonObject) -> ModelConfig:
        """From a ``config.json`` dict (transformers 4.x ``rope_scaling`` or 5.x
        ``rope_parameters``)."""
        model_type = cfg.get("model_type", "llama")
        rope_params = dict(cfg.get("rope_parameters") or {})
        scaling = dict(cfg.get("rope_scaling") or {})
        rope_params.update(scaling)
        theta = rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
        rope = RopeConfig(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(rope_params.get("factor", 1.0)),
            low_freq_factor=float(rope_params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope_params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                rope_params.get("original_max_position_embeddings",
                                cfg.get("max_position_embeddings", 8192))),
        )
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            model_type=model_type,
        )
