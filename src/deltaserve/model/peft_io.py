"""Adapters on disk in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``,
which ``peft``, ``transformers`` and vLLM (``--lora-modules``) load unchanged."""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors.torch import load_file, save_file

from deltaserve.core.errors import InputError, require
from deltaserve.model.config import ModelConfig
from deltaserve.model.lora import ALL_MODULES, AdapterWeights, LoRAConfig

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def peft_config_dict(lora: LoRAConfig, base_model: str) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def save_adapter(path: str | os.PathLike, adapter: AdapterWeights, base_model: str) -> Path:
    """Write ``adapter`` into directory ``path`` (created). Not atomic by itself: checkpoints
    write into a temporary directory and rename it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(adapter.to_peft_state_dict(), str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    (path / CONFIG_NAME).write_text(
        json.dumps(peft_config_dict(adapter.config, base_model), indent=2))
    return path


def read_lora_config(path: str | os.PathLike) -> LoRAConfig:
    path = Path(path)
    try:
        cfg = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError("adapter", str(path), f"no readable {CONFIG_NAME}: {e}") from e
    require(cfg.get("peft_type", "LORA") == "LORA", "peft_type", cfg.get("peft_type"),
            "only LoRA adapters are supported")
    for flag in ("use_rslora", "use_dora", "fan_in_fan_out"):
        require(not cfg.get(flag, False), flag, cfg.get(flag), "not supported")
    require(cfg.get("bias", "none") == "none", "bias", cfg.get("bias"), "only bias='none'")
    targets = cfg["target_modules"]
    if isinstance(targets, str):
        raise InputError("target_modules", targets, "a regex target is not supported; list them")
    return LoRAConfig(r=int(cfg["r"]), alpha=float(cfg["lora_alpha"]),
                      dropout=float(cfg.get("lora_dropout", 0.0)),
                      target_modules=tuple(sorted(targets, key=_module_order)))


def _module_order(m: str) -> int:
    return ALL_MODULES.index(m) if m in ALL_MODULES else len(ALL_MODULES)


def load_adapter(path: str | os.PathLike, model: ModelConfig) -> AdapterWeights:
    path = Path(path)
    lora = read_lora_config(path)
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise InputError("adapter", str(path), f"no {WEIGHTS_NAME}")
    return AdapterWeights(model, lora).load_peft_state_dict_(load_file(str(weights)))
