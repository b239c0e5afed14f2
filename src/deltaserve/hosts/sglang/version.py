"""Which SGLang this host supports, and importing it.

The host reaches SGLang through its plugin entry points and ``HookRegistry``, but the objects
behind them (the ``Scheduler``'s queues, the LoRA memory pool's buffers, ``ForwardBatch``'s token
layout) are not a stable API, so the supported release is pinned here and checked before any
DeltaServe class touches them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

SUPPORTED_VERSIONS: tuple[str, ...] = ("0.5.23",)

# Set by DeltaServe when it drives SGLang (inherited by SGLang's processes): the plugin, which
# SGLang loads in every process of every run once DeltaServe is installed, installs the
# co-serving hooks only then.
ACTIVE_ENV = "DELTASERVE_SGLANG"
# Set by `deltaserve serve --engine sglang`: names the co-serving spec its scheduler process
# starts with (deltaserve.hosts.sglang.serve_spec).
SERVE_ENV = "DELTASERVE_SGLANG_SERVE"


class UnsupportedSGLangVersion(RuntimeError):
    """The installed SGLang is not one DeltaServe's SGLang host was built and tested against."""

    def __init__(self, found: str):
        self.found = found
        super().__init__(
            f"DeltaServe's SGLang host supports SGLang {', '.join(SUPPORTED_VERSIONS)}; found "
            f"SGLang {found}. Create the SGLang environment with "
            f"`bash scripts/bootstrap.sh --sglang` (pins sglang=={SUPPORTED_VERSIONS[-1]}).")


def check_version(found: str) -> str:
    if found not in SUPPORTED_VERSIONS:
        raise UnsupportedSGLangVersion(found)
    return found


def import_sglang() -> ModuleType:
    """Import SGLang, check its release and mark this process (and its children) as driven by
    DeltaServe. Raises :class:`ImportError` with the install command when SGLang is missing."""
    if importlib.util.find_spec("sglang") is None:
        raise ImportError("the SGLang host needs SGLang: create its environment with "
                          "`bash scripts/bootstrap.sh --sglang` and use .venv-sglang")
    os.environ[ACTIVE_ENV] = "1"
    sglang = importlib.import_module("sglang")  # the lazy engine import
    check_version(str(sglang.__version__))
    return sglang
