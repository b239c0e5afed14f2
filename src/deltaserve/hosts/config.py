"""The engine knobs every host has. Each host's own config extends this one, so a default is
written once whichever host runs (the bench and the CLI build hosts from it)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from deltaserve.core.errors import require, require_choice
from deltaserve.model.random_models import is_random, random_config

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_MAX_MODEL_LEN = 4096  # without max_model_len: the model's limit, at most this


@dataclass(frozen=True)
class HostConfig:
    """``model``: a Hugging Face directory, a ``.gguf`` file, a built-in name (``smollm2``) or
    a random-weight model of a published shape for timing (``random:llama-3-8b``, see
    :mod:`deltaserve.model.random_models`).
    ``dtype``: ``auto`` takes bfloat16 where the hardware has native bf16 matmul, else float32
    (see :func:`deltaserve.model.loading.resolve_dtype`). ``max_num_batched_tokens``: tokens per
    step (prefills are chunked to fit). ``max_model_len``: longest prompt + output (default:
    the model's own limit, capped at 4096 and at the KV cache). ``kv_cache_tokens``: KV-cache
    capacity in tokens. ``num_threads``: the engine's CPU threads (default: torch's).
    ``device``: where the embedded engine runs, ``cpu`` or ``cuda[:N]`` (checked here, before
    any model loads; the other hosts take their device from their engine and accept only
    ``cpu``, see :data:`deltaserve.hosts.registry.HOSTS`)."""

    model: str = "smollm2"
    dtype: str = "auto"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    max_model_len: int | None = None
    kv_cache_tokens: int = 32_768
    seed: int = 0
    num_threads: int | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        check_device(self.device)
        if is_random(self.model):
            random_config(self.model)  # an unknown shape names the choices before any load
        require(bool(self.model), "model", self.model, "a model directory, .gguf or built-in name")
        require_choice("dtype", self.dtype, DTYPES)
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        if self.max_model_len is not None:
            require(self.max_model_len >= 2, "max_model_len", self.max_model_len, "must be >= 2")
            require(self.max_model_len <= self.kv_cache_tokens, "max_model_len",
                    self.max_model_len,
                    f"a sequence must fit the KV cache of {self.kv_cache_tokens} tokens")
        require(self.num_threads is None or self.num_threads >= 1, "num_threads",
                self.num_threads, "must be >= 1")

    @property
    def device_type(self) -> str:
        """``cpu`` or ``cuda`` (the device without its index)."""
        return self.device.split(":", 1)[0]

    def model_len(self, model_limit: int) -> int:
        """The longest sequence this host serves, given the model's own limit."""
        limit = self.max_model_len or min(model_limit, DEFAULT_MAX_MODEL_LEN)
        return min(limit, model_limit, self.kv_cache_tokens)

    def common(self) -> HostConfig:
        """Just the fields every host shares (to build another host's config from)."""
        return HostConfig(**{f: getattr(self, f) for f in HostConfig.__dataclass_fields__})


def check_device(device: str) -> None:
    """``cpu``, or a CUDA device this machine has (an input error naming ``device`` otherwise)."""
    require(device == "cpu" or re.fullmatch(r"cuda(:\d+)?", device) is not None, "device",
            device, "choose cpu, cuda or cuda:N")
    if device == "cpu":
        return
    require(torch.cuda.is_available(), "device", device,
            f"CUDA is not available here (torch {torch.__version__}, "
            f"CUDA build: {torch.version.cuda or 'none'}); use --device cpu")
    index = int(device.split(":")[1]) if ":" in device else 0
    count = torch.cuda.device_count()
    require(index < count, "device", device, f"this machine has {count} CUDA device(s)")
