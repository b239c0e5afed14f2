"""DeltaServe's ``sglang.srt.plugins`` entry point.

SGLang calls :func:`register` once in each of its processes (``load_plugins``: the process that
builds the ``Engine`` or the HTTP server, each scheduler process, the detokenizer) before it
builds the scheduler, and then applies the hooks registered in its ``HookRegistry``. It logs and
swallows what a plugin raises, so a failure here must not be relied on to stop SGLang.

Installed beside any SGLang, the plugin stays inert unless DeltaServe drives that SGLang
(``DELTASERVE_SGLANG`` set: :func:`~deltaserve.hosts.sglang.version.import_sglang` sets it, and
SGLang's processes inherit it). Then it:

* checks the SGLang release;
* where no CUDA device exists, registers the ``pin_memory`` shim of :mod:`.compat`, without
  which SGLang's LoRA code cannot run on such a machine;
* replaces SGLang's ``Scheduler`` with
  :class:`~deltaserve.hosts.sglang.scheduler.CoServingScheduler` (a ``REPLACE`` hook on the
  class, the form ``hook_registry.py`` documents for scheduler subclasses), so the scheduler
  process SGLang spawns runs DeltaServe's subclass (under ``deltaserve serve --engine sglang``,
  :class:`~deltaserve.hosts.sglang.serving.ServingScheduler`, which co-serves from the start).

A plain SGLang run in the same environment is untouched: no shim, no subclass (on a machine
without CUDA its LoRA then fails as it does without DeltaServe; ``DELTASERVE_SGLANG=1`` opts in).
"""

from __future__ import annotations

import importlib
import logging
import os

import sglang
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from deltaserve.hosts.sglang.compat import register_pin_memory_shim
from deltaserve.hosts.sglang.version import ACTIVE_ENV, SERVE_ENV, check_version

logger = logging.getLogger("deltaserve.sglang")

SCHEDULER_TARGET = "sglang.srt.managers.scheduler.Scheduler"
# DeltaServe's scheduler by whether `deltaserve serve` drives SGLang's server (co-serving from
# start) or a host builds the scheduler itself. Named, not imported: a plain SGLang process
# with the plugin installed never imports DeltaServe's scheduler (and torch-side training code).
SCHEDULERS = {True: ("deltaserve.hosts.sglang.serving", "ServingScheduler"),
              False: ("deltaserve.hosts.sglang.scheduler", "CoServingScheduler")}


def register() -> None:
    if not os.environ.get(ACTIVE_ENV):
        return
    check_version(str(sglang.__version__))
    register_pin_memory_shim()
    module, name = SCHEDULERS[bool(os.environ.get(SERVE_ENV))]
    scheduler_cls = getattr(importlib.import_module(module), name)  # the lazy import
    HookRegistry.register(SCHEDULER_TARGET, scheduler_cls, HookType.REPLACE)
    logger.debug("DeltaServe SGLang plugin: SGLang %s, pid %d", sglang.__version__, os.getpid())
