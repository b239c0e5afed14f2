"""Attach co-serving to an embedded engine, and detach it.

    engine = LLMEngine(EngineConfig(model="smollm2"))
    co = attach(engine, dataset="data.jsonl", slo=SLOConfig(ttft_s=2.0, tpot_s=0.3))
    ... serve requests (engine.run_loop in a thread, engine.add_request from clients) ...
    detach(engine)   # trains what was captured, writes a checkpoint, stops the backward
"""

from __future__ import annotations

import os

from deltaserve.core.admission import AdmissionScheduler
from deltaserve.core.calibration import CalibrationConfig
from deltaserve.core.errors import InputError
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.slo import SLOConfig
from deltaserve.hosts.native.calibrate import calibrate
from deltaserve.train.attach_args import (
    Dataset,
    resolve_config,
    resolve_latency_model,
    resolve_samples,
)
from deltaserve.train.coserver import CoServeConfig, CoServer


def attach(engine, *, dataset: Dataset,
           slo: SLOConfig | None = None, config: CoServeConfig | None = None,
           latency_model: LatencyModel | str | os.PathLike | None = None,
           calibration: CalibrationConfig | None = None, progress: bool = True,
           scheduler_cls: type[AdmissionScheduler] = AdmissionScheduler,
           **overrides) -> CoServer:
    """Start co-serving on ``engine``.

    ``dataset``: a path (Alpaca JSON/JSONL or chat JSONL), a :class:`DataConfig`, or samples
    already tokenized. ``config``: a full :class:`CoServeConfig`; otherwise ``slo`` plus any of
    its fields as keyword overrides (``lora=``, ``optimizer=``, ``admission=``, ...).
    ``latency_model``: a fitted model or its JSON; by default the engine is calibrated now.
    ``scheduler_cls``: the admission policy (Algorithm 1; baselines substitute their own).
    """
    if engine.coserver is not None:
        raise InputError("coserver", "attached", "detach the current co-server first")
    config = resolve_config(config, slo, overrides)
    samples = resolve_samples(dataset, engine.tokenizer, engine.limits.max_tokens_per_step)
    latency_model = resolve_latency_model(latency_model)
    if latency_model is None:
        latency_model = calibrate(engine, config.lora, calibration, config.latency,
                                  seed=config.seed, progress=progress)
    engine.latency_model = latency_model
    co = CoServer(config, engine.limits, engine.model, samples, base_model=engine.model_path,
                  latency_model=latency_model, scheduler_cls=scheduler_cls)
    engine.coserver = co
    return co


def detach(engine, *, drain: bool = True, checkpoint: bool = True) -> CoServer | None:
    """Stop co-serving: train what was captured (``drain``), checkpoint, stop the backward."""
    co = engine.coserver
    if co is None:
        return None
    engine.coserver = None
    co.close(drain=drain, checkpoint=checkpoint)
    return co
