"""Every host attaches through one recipe: no host class overrides :meth:`BaseHost.attach`
(what differs between hosts enters as their training half and their config check), so the
sequence the fake host runs in ``test_fake_host.py`` is the one every registered host runs."""

from __future__ import annotations

import importlib.util

import pytest

from deltaserve.hosts.base import BaseHost
from deltaserve.hosts.registry import HOSTS, host_class

ENGINES = {"vllm": ("vllm", pytest.mark.engine), "sglang": ("sglang", pytest.mark.sglang)}


def _host_params() -> list[object]:
    out: list[object] = []
    for name in HOSTS:
        engine = ENGINES.get(name)
        out.append(pytest.param(name, marks=engine[1]) if engine else name)
    return out


@pytest.mark.parametrize("name", _host_params())
def test_every_host_attaches_through_the_base_hosts_recipe(name):
    engine = ENGINES.get(name)
    if engine is not None and importlib.util.find_spec(engine[0]) is None:
        pytest.skip(f"{engine[0]} is not installed in this venv")
    cls = host_class(name)
    assert cls.attach is BaseHost.attach, f"{cls.__name__} overrides attach"
