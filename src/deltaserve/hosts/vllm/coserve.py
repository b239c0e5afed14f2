"""Attach co-serving to a vLLM host, and detach it (the same signature as the embedded host's
:func:`deltaserve.hosts.native.coserve.attach`)::

    host = VLLMHost(VLLMHostConfig(model="smollm2"))
    co = attach(host, dataset="data.jsonl", slo=SLOConfig(ttft_s=2.0, tpot_s=0.3))
    ... host.run_loop in a thread, host.add_request from clients ...
    detach(host)   # trains what was captured, writes a checkpoint, stops the backward

or, with vLLM's own offline API::

    llm = vllm.LLM(model=path, **engine_kwargs())
    co = attach(llm, dataset=..., slo=...)
    llm.generate(prompts)            # training rides in these steps
    train_while_idle(llm, seconds=30)  # and in training-only steps when no client is waiting

Attaching: the reserved training adapter is loaded into vLLM (PEFT's initial weights) and pinned
to a slot, the calibration plan runs through vLLM's scheduler and forward, and the co-server
starts with the backward's base weights (views of vLLM's on GPU, reloaded from the model
directory on CPU) and publishes into the reserved slot after every optimizer step.

vLLM's LoRA forward applies no dropout, so the activations captured inside it are those of a
dropout-free forward; the backward must replay that forward, so the co-server's
``lora.dropout`` is forced to 0.0 on this host.
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from deltaserve.core.admission import AdmissionScheduler
from deltaserve.core.calibration import CalibrationConfig
from deltaserve.core.data import TrainingSample
from deltaserve.core.errors import InputError
from deltaserve.core.latency_model import LatencyModel, LatencyModelConfig
from deltaserve.core.slo import SLOConfig
from deltaserve.hosts.vllm.registry import EngineLink
from deltaserve.model.config import ModelConfig
from deltaserve.model.llama import LlamaModel
from deltaserve.model.lora import AdapterWeights, LoRAConfig
from deltaserve.model.peft_io import save_adapter
from deltaserve.train.attach_args import (
    Dataset,
    resolve_config,
    resolve_latency_model,
    resolve_samples,
)
from deltaserve.train.coserver import CoServeConfig, CoServer

TRAIN_ADAPTER_NAME = "deltaserve-train"
# vLLM LoRA int id of the reserved training adapter; client adapters count up from 1.
TRAIN_ADAPTER_ID = 1_000_000


def coserve_config(config: CoServeConfig | None, slo: SLOConfig | None,
                   overrides: dict[str, Any]) -> CoServeConfig:
    """The co-server's config for this host: ``lora.dropout`` forced to 0.0 (module docstring)."""
    config = resolve_config(config, slo, overrides)
    if config.lora.dropout != 0.0:
        warnings.warn(f"lora_dropout={config.lora.dropout}: vLLM's LoRA forward applies no "
                      "dropout, so the backward on the vLLM host trains with lora_dropout=0.0 "
                      "(its gradients must be those of the forward that produced the "
                      "activations)", stacklevel=3)
        config = replace(config, lora=replace(config.lora, dropout=0.0))
    return config


def check_lora_fits(lora: LoRAConfig, vllm_config: Any) -> None:
    lc = vllm_config.lora_config
    if lc is None:
        raise InputError("enable_lora", False, "the training adapter needs vLLM's LoRA support")
    if lora.r > lc.max_lora_rank:
        raise InputError("lora_r", lora.r, f"exceeds vLLM's max_lora_rank={lc.max_lora_rank}; "
                         "start vLLM with a larger max_lora_rank")


def write_standin_adapter(model: ModelConfig, lora: LoRAConfig, seed: int, base_model: str
                          ) -> str:
    """PEFT's initial weights for ``lora`` in a fresh directory: what vLLM loads into the
    reserved slot (the co-server publishes its own weights over it when it starts)."""
    path = tempfile.mkdtemp(prefix="deltaserve-train-adapter-")
    save_adapter(path, AdapterWeights(model, lora).init_peft_(seed), base_model)
    return path


def new_calibration(link: EngineLink, facts: Any, calibration: CalibrationConfig | None,
                    latency: LatencyModelConfig | None, seed: int, on_probe=None, on_done=None
                    ) -> Any:
    """A :class:`CalibrationRun` of ``calibration`` on the engine behind ``link`` (``facts``: a
    host, or the engine process's stand-in for one). The training adapter must be reserved."""
    from deltaserve.hosts.vllm.calibrate import CalibrationRun

    if link.train_lora is None:
        raise RuntimeError("reserve the training adapter before calibrating")
    sched = link.scheduler
    mc = facts.model_config
    return CalibrationRun(
        facts.limits, calibration, latency, vocab_size=mc.vocab_size, num_layers=mc.num_layers,
        hidden_size=mc.hidden_size, dtype=facts.dtype, train_lora=link.train_lora,
        block_size=sched.block_size, prefix_caching=sched.cache_config.enable_prefix_caching,
        seed=seed, on_probe=on_probe, on_done=on_done)


def start_coserver(link: EngineLink, facts: Any, config: CoServeConfig,
                   samples: Sequence[TrainingSample], latency_model: LatencyModel,
                   scheduler_cls: type[AdmissionScheduler] = AdmissionScheduler) -> CoServer:
    """Build the co-server on the engine behind ``link`` and publish its adapter to vLLM."""
    from deltaserve.hosts.vllm.weights import backward_weights

    model = LlamaModel(*backward_weights(link.worker.model_runner.model, facts.model_path,
                                         facts.dtype))
    publisher = link.publisher
    co = CoServer(config, facts.limits, model, samples, base_model=facts.model_path,
                  latency_model=latency_model, on_publish=publisher.publish,
                  scheduler_cls=scheduler_cls)
    publisher.publish(co.adapter)  # the slot now holds exactly what the backward trains
    link.latency_model = latency_model
    link.coserver = co
    return co


def host_of(engine: Any) -> Any:
    """The :class:`VLLMHost` of ``engine`` (a host, or a ``vllm.LLM`` started with
    :func:`engine_kwargs`)."""
    from deltaserve.hosts.vllm.host import VLLMHost

    if isinstance(engine, VLLMHost):
        return engine
    from deltaserve.hosts.vllm import registry

    link = registry.find_link(engine.llm_engine.vllm_config)
    if link is not None and link.host is not None:
        return link.host
    return VLLMHost(llm=engine)


def attach(engine: Any, *, dataset: Dataset,
           slo: SLOConfig | None = None, config: CoServeConfig | None = None,
           latency_model: LatencyModel | str | os.PathLike | None = None,
           calibration: CalibrationConfig | None = None, progress: bool = True,
           scheduler_cls: type[AdmissionScheduler] = AdmissionScheduler,
           **overrides: Any) -> CoServer:
    """Start co-serving on ``engine`` (a :class:`VLLMHost` or a ``vllm.LLM``); same arguments as
    the embedded host's ``attach``. The engine must be idle while it calibrates."""
    from deltaserve.hosts.vllm.calibrate import calibrate

    host = host_of(engine)
    link = host.link
    if link.coserver is not None:
        raise InputError("coserver", "attached", "detach the current co-server first")
    config = coserve_config(config, slo, overrides)
    check_lora_fits(config.lora, host.vllm_config)
    samples = resolve_samples(dataset, host.tokenizer, host.limits.max_tokens_per_step)
    host.reserve_training_adapter(config.lora, config.seed)
    latency_model = resolve_latency_model(latency_model)
    if latency_model is None:
        latency_model = calibrate(host, config.lora, calibration, config.latency,
                                  seed=config.seed, progress=progress)
    return start_coserver(link, host, config, samples, latency_model, scheduler_cls)


def detach(engine: Any, *, drain: bool = True, checkpoint: bool = True) -> CoServer | None:
    """Stop co-serving: train what was captured (``drain``), checkpoint, stop the backward. The
    training adapter stays loaded (and pinned) with its last published weights."""
    host = host_of(engine)
    co = host.link.coserver
    if co is None:
        return None
    host.link.coserver = None
    co.close(drain=drain, checkpoint=checkpoint)
    return co


def train_while_idle(engine: Any, seconds: float | None = None,
                     until: Callable[[CoServer], bool] | None = None) -> None:
    """Keep stepping an attached engine with no client work (training-only steps and backward
    commits) for ``seconds`` or until ``until(co)``; for use with ``vllm.LLM``, whose
    ``generate`` only steps while its own requests are unfinished."""
    host = host_of(engine)
    co = host.link.coserver
    if co is None:
        raise InputError("coserver", None, "attach a co-server first")
    deadline = None if seconds is None else time.monotonic() + seconds
    while (deadline is None or time.monotonic() < deadline) and not (until and until(co)):
        if not host.step():
            if not co.backward_busy and not co.has_pending_training \
                    and co.pool.smallest_available() is None:
                return  # nothing left to train
            co.idle(timeout_s=0.01)
