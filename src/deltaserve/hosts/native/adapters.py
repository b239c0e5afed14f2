"""Serving LoRA adapters by name: loaded from PEFT directories, batched per step."""

from __future__ import annotations

import os

from deltaserve.core.errors import InputError
from deltaserve.hosts.base import RESERVED_ADAPTER_PREFIX
from deltaserve.model.config import ModelConfig
from deltaserve.model.lora import AdapterWeights
from deltaserve.model.peft_io import load_adapter

# The co-server's training adapter as the runner's rows name it. Reserved: no client can load or
# request it through the host; the engine's own callers (calibration, tests) may decode on it.
TRAIN_ADAPTER = f"{RESERVED_ADAPTER_PREFIX}train"


class AdapterRegistry:
    def __init__(self, model: ModelConfig):
        self.model = model
        self._adapters: dict[str, AdapterWeights] = {}

    def add(self, name: str, adapter: AdapterWeights | str | os.PathLike) -> AdapterWeights:
        if not isinstance(adapter, AdapterWeights):
            adapter = load_adapter(adapter, self.model)
        self._adapters[name] = adapter
        return adapter

    def remove(self, name: str) -> None:
        self._adapters.pop(name, None)

    def get(self, name: str) -> AdapterWeights:
        try:
            return self._adapters[name]
        except KeyError:
            raise InputError("adapter", name, f"not loaded; loaded: {sorted(self._adapters)}"
                             ) from None

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def names(self) -> list[str]:
        return sorted(self._adapters)
