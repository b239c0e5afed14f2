"""The vLLM host: DeltaServe inside an unmodified vLLM, through its official extension points.

* ``scheduler_cls`` = :class:`~deltaserve.hosts.vllm.scheduler.CoServingScheduler`: admission
  (Algorithm 1) on vLLM's proposed batch, training samples as hidden prefill-only requests.
* ``worker_extension_cls`` = :class:`~deltaserve.hosts.vllm.worker_ext.CoServingWorkerExtension`:
  forward hooks that time each forward, capture the training rows' layer inputs and cut
  training-only steps short; the reserved training adapter's slot and its publisher.
* ``vllm.general_plugins`` entry point :func:`~deltaserve.hosts.vllm.plugin.register`: the
  version check in every vLLM process that runs DeltaServe.

Supported vLLM releases: :data:`~deltaserve.hosts.vllm.version.SUPPORTED_VERSIONS`.

Python usage with ``vllm.LLM`` (in-process engine; on CPU set the environment of
:data:`~deltaserve.hosts.vllm.version.CPU_ENV_DEFAULTS` first, or import this package's
``import_vllm``)::

    from deltaserve.hosts.vllm import attach, detach, engine_kwargs, import_vllm, train_while_idle
    vllm = import_vllm()
    llm = vllm.LLM(model="/path/to/hf-model", **engine_kwargs())
    co = attach(llm, dataset="train.jsonl", slo=SLOConfig(ttft_s=2.0, tpot_s=0.2))
    outputs = llm.generate(prompts, vllm.SamplingParams(max_tokens=64))
    train_while_idle(llm, seconds=60)
    detach(llm)  # checkpoint in PEFT format under config.checkpoint.root

Serving: ``deltaserve serve --host vllm MODEL --finetune-dataset PATH`` (:mod:`.serve`).

Importing this package does not import vLLM; its names load on first use. It does put the CPU
runtime defaults (:data:`~deltaserve.hosts.vllm.version.CPU_ENV_DEFAULTS`) into the environment,
where unset, when the installed vLLM is the CPU build and not yet imported: vLLM reads them when
it is first imported, and every module of this package that imports vLLM is imported after this.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from deltaserve.hosts.vllm.version import is_cpu_build, set_cpu_env_defaults

if "vllm" not in sys.modules and is_cpu_build():
    set_cpu_env_defaults()

_EXPORTS = {
    "VLLMHost": "deltaserve.hosts.vllm.host",
    "VLLMHostConfig": "deltaserve.hosts.vllm.config",
    "engine_kwargs": "deltaserve.hosts.vllm.config",
    "attach": "deltaserve.hosts.vllm.coserve",
    "detach": "deltaserve.hosts.vllm.coserve",
    "train_while_idle": "deltaserve.hosts.vllm.coserve",
    "import_vllm": "deltaserve.hosts.vllm.version",
    "SUPPORTED_VERSIONS": "deltaserve.hosts.vllm.version",
    "UnsupportedVLLMVersion": "deltaserve.hosts.vllm.version",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
