"""The SGLang host: DeltaServe inside an unmodified SGLang 0.5.23, through its official
extension points (see ``docs/sglang.md``).

* ``sglang.srt.plugins`` entry point :func:`~deltaserve.hosts.sglang.plugin.register`: the
  ``pin_memory`` shim (:mod:`.compat`) where no CUDA device exists, and DeltaServe's scheduler
  subclass when DeltaServe drives SGLang.
* :class:`~deltaserve.hosts.sglang.scheduler.CoServingScheduler`: SGLang's ``Scheduler`` with
  the co-server's step protocol inside it (plan, hidden training requests, capture, interrupt,
  one report per step).
* :class:`~deltaserve.hosts.sglang.host.SGLangHost`: that scheduler and its model runner built
  in the caller's process, as a :class:`~deltaserve.hosts.base.BaseHost` (``create_host
  ("sglang")``);
* :class:`~deltaserve.hosts.sglang.serving.ServingScheduler` and :mod:`.serve_spec`: what SGLang's
  own OpenAI server runs with co-serving on (started by
  :mod:`deltaserve.entrypoints.serve_sglang`).

Importing this package imports neither SGLang nor torch; its names load on first use.
"""

from __future__ import annotations

from deltaserve.hosts.lazy import lazy_exports

_EXPORTS = {
    "SGLangHost": "deltaserve.hosts.sglang.host",
    "SGLangConfig": "deltaserve.hosts.sglang.config",
    "import_sglang": "deltaserve.hosts.sglang.version",
    "SUPPORTED_VERSIONS": "deltaserve.hosts.sglang.version",
    "UnsupportedSGLangVersion": "deltaserve.hosts.sglang.version",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
