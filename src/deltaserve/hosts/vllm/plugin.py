"""DeltaServe's ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` once in every process it starts (the front end, the engine core and
each worker) before it builds the scheduler or the worker, and does not catch what it raises.
Installed beside any vLLM, the plugin must therefore stay inert unless DeltaServe drives that
vLLM: it acts only when ``DELTASERVE_VLLM`` is set (the host and ``deltaserve serve`` set it, and
vLLM's processes inherit it). Then it checks the vLLM release, so an unsupported vLLM stops at
start-up in every process with one clear message, before any DeltaServe class touches vLLM
internals that may have changed; and it registers the model architecture of the compile-safe
capture path (:mod:`deltaserve.hosts.vllm.aux_model`, a new name: no existing model changes)
before vLLM builds the model.
"""

from __future__ import annotations

import importlib
import logging
import os

from deltaserve.hosts.vllm.version import ACTIVE_ENV, SUPPORTED_VERSIONS, check_version

logger = logging.getLogger("deltaserve.vllm")

AUX_MODEL_MODULE = "deltaserve.hosts.vllm.aux_model"


def register() -> None:
    if not os.environ.get(ACTIVE_ENV):
        return
    # Both by name, not imported at module level: installed beside another user's vLLM this
    # module imports nothing of vLLM's, and aux_model (which subclasses vLLM's Llama) may only
    # be imported once the version is known to be one it was written for.
    vllm = importlib.import_module("vllm")
    check_version(str(vllm.__version__))
    aux_model = importlib.import_module(AUX_MODEL_MODULE)
    aux_model.register_aux_capture_model()
    logger.debug("DeltaServe vLLM plugin: vLLM %s (supported: %s), pid %d", vllm.__version__,
                 ", ".join(SUPPORTED_VERSIONS), os.getpid())
