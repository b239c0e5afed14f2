"""The vLLM host: DeltaServe inside an unmodified vLLM, through its official extension points.

* ``scheduler_cls`` = :class:`~deltaserve.hosts.vllm.scheduler.CoServingScheduler`: the
  co-server's step (Algorithm 1) on vLLM's proposed batch, training samples as hidden
  prefill-only requests.
* ``worker_extension_cls`` = :class:`~deltaserve.hosts.vllm.worker_ext.CoServingWorkerExtension`:
  forward hooks that time each forward, capture the training rows' layer inputs and cut
  training-only steps short.
* ``vllm.general_plugins`` entry point :func:`~deltaserve.hosts.vllm.plugin.register`: the
  version check in every vLLM process that runs DeltaServe.

:class:`~deltaserve.hosts.vllm.host.VLLMHost` is the host (``create_host("vllm")``); it wraps
a ``vllm.LLM`` it starts, or one started with :func:`engine_kwargs`. Serving:
``deltaserve serve --engine vllm MODEL`` (:mod:`deltaserve.entrypoints.serve_vllm`). Supported
vLLM releases: :data:`~deltaserve.hosts.vllm.version.SUPPORTED_VERSIONS`.

Importing this package does not import vLLM; its names load on first use. It does put the CPU
runtime defaults (:data:`~deltaserve.hosts.vllm.version.CPU_ENV_DEFAULTS`) into the environment,
where unset, when the installed vLLM is the CPU build and not yet imported: vLLM reads them when
it is first imported, and every module of this package that imports vLLM is imported after this.
"""

from __future__ import annotations

import sys

from deltaserve.hosts.lazy import lazy_exports
from deltaserve.hosts.vllm.version import is_cpu_build, set_cpu_env_defaults

if "vllm" not in sys.modules and is_cpu_build():
    set_cpu_env_defaults()

_EXPORTS = {
    "VLLMHost": "deltaserve.hosts.vllm.host",
    "train_while_idle": "deltaserve.hosts.vllm.host",
    "VLLMHostConfig": "deltaserve.hosts.vllm.config",
    "engine_kwargs": "deltaserve.hosts.vllm.config",
    "import_vllm": "deltaserve.hosts.vllm.version",
    "SUPPORTED_VERSIONS": "deltaserve.hosts.vllm.version",
    "UnsupportedVLLMVersion": "deltaserve.hosts.vllm.version",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
