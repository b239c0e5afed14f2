"""Co-serving inside the engine-core process of ``deltaserve serve``.

vLLM's OpenAI server runs the engine core in a process of its own; with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` in its environment that process holds the scheduler and the
worker together, so the co-server lives there too. The API server reaches it only through the
worker extension's RPCs (:class:`RemoteSpec` crosses as a JSON-able dict). Attaching cannot
block inside an RPC (the RPC runs on the engine's busy loop, which must keep stepping to run the
calibration), so it is a small state machine: ``calibrating`` → ``coserving`` (or ``failed``),
which the API server polls before it accepts requests.
"""

from __future__ import annotations

import shutil
import traceback
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from deltaserve.core.admission import AdmissionConfig, AdmissionMode
from deltaserve.core.calibration import CalibrationConfig, HostLimits
from deltaserve.core.data import DataConfig, load_dataset
from deltaserve.core.errors import require, require_choice
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.shape import StepShape
from deltaserve.core.slo import SLOConfig
from deltaserve.hosts.vllm import registry
from deltaserve.model.config import ModelConfig
from deltaserve.model.lora import ALL_MODULES, DEFAULT_TARGETS, LoRAConfig
from deltaserve.train.checkpoint import CheckpointConfig, find_latest
from deltaserve.train.coserver import CoServeConfig
from deltaserve.train.optim import OptimizerConfig

# A sweep small enough to finish in about a minute on a 2-core CPU.
QUICK_CALIBRATION = CalibrationConfig(split_total=128, max_split=4, decode_batches=(1, 4, 16),
                                      decode_kv_lens=(64, 256), ft_totals=(64, 256), repeats=2)
# Serving engine loop: block up to this long in ``schedule()`` when only the backward is busy.
IDLE_WAIT_S = 0.005
# Without mid-step interruption (see RemoteSpec), a training-only step may cost at most this
# share of the TTFT objective of a request that arrives just after it started.
UNINTERRUPTIBLE_TTFT_SHARE = 0.25


@dataclass(frozen=True)
class RemoteSpec:
    """What ``deltaserve serve`` asks the engine process to co-serve (every field JSON-able).
    ``calibration``: ``quick`` or ``full`` (ignored with ``latency_model``, a fitted model's
    JSON). ``max_ft_tokens_per_step`` caps the fine-tuning tokens of a step. In the serving
    process a client request reaches the scheduler only between steps (vLLM's input thread
    queues it for the busy loop), so a training-only step cannot be cut short there: the cap is
    further lowered until the latency model predicts such a step within
    :data:`UNINTERRUPTIBLE_TTFT_SHARE` of the TTFT objective (:func:`uninterruptible_cap`)."""

    dataset: str
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.2
    lora_r: int = 16
    lora_alpha: float = 32.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    lr: float = 1e-3
    backward_batch_tokens: int = 256
    max_ft_tokens_per_step: int = 256
    num_epochs: int | None = 1
    admission: str = AdmissionMode.FULL.value
    checkpoint_dir: str | None = None
    checkpoint_every: int = 50
    calibration: str = "quick"
    latency_model: str | None = None
    seed: int = 0
    max_sample_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(bool(self.dataset), "finetune_dataset", self.dataset, "a dataset path is needed")
        require_choice("calibration", self.calibration, ("quick", "full"))
        require_choice("admission", self.admission, tuple(m.value for m in AdmissionMode))
        bad = [m for m in self.target_modules if m not in ALL_MODULES]
        require(not bad, "lora_target_modules", bad, f"choose from {', '.join(ALL_MODULES)}")
        require(self.max_ft_tokens_per_step > 0, "max_ft_tokens_per_step",
                self.max_ft_tokens_per_step, "must be > 0")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["target_modules"] = list(self.target_modules)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RemoteSpec:
        return cls(**{**d, "target_modules": tuple(d.get("target_modules", DEFAULT_TARGETS))})

    def coserve_config(self) -> CoServeConfig:
        return CoServeConfig(
            slo=SLOConfig(self.ttft_slo_s, self.tpot_slo_s),
            admission=AdmissionConfig(AdmissionMode(self.admission), self.max_ft_tokens_per_step),
            lora=LoRAConfig(self.lora_r, self.lora_alpha, 0.0, tuple(self.target_modules)),
            optimizer=OptimizerConfig(lr=self.lr),
            checkpoint=CheckpointConfig(root=self.checkpoint_dir,
                                        every_steps=self.checkpoint_every),
            backward_batch_tokens=self.backward_batch_tokens, num_epochs=self.num_epochs,
            seed=self.seed, **self.extra)


@dataclass
class EngineFacts:
    """What attaching needs to know about the engine it runs in (a host's stand-in)."""

    limits: HostLimits
    model_config: ModelConfig
    dtype: torch.dtype
    model_path: str
    tokenizer: Any


def engine_facts(worker: Any) -> EngineFacts:
    from deltaserve.hosts.vllm.config import engine_limits
    from deltaserve.model.loading import load_tokenizer, read_config, resolve_model

    vc = worker.vllm_config
    link = registry.link_for(vc)
    path = str(vc.model_config.model)
    return EngineFacts(engine_limits(vc, link.scheduler), read_config(resolve_model(path)),
                       vc.model_config.dtype, path, load_tokenizer(path))


def begin_remote_attach(worker: Any, spec_json: dict[str, Any]) -> dict[str, Any]:
    from deltaserve.hosts.vllm.coserve import (
        TRAIN_ADAPTER_ID,
        TRAIN_ADAPTER_NAME,
        check_lora_fits,
        new_calibration,
        start_coserver,
        write_standin_adapter,
    )

    link = registry.link_for(worker.vllm_config)
    if link.coserver is not None or link.calibration is not None:
        return remote_status(worker)
    link.remote = {"state": "starting"}
    try:
        spec = RemoteSpec.from_json(spec_json)
        config = spec.coserve_config()
        facts = engine_facts(worker)
        check_lora_fits(config.lora, worker.vllm_config)
        max_tokens = min(spec.max_sample_tokens or facts.limits.max_tokens_per_step,
                         facts.limits.max_tokens_per_step, facts.limits.max_model_len)
        samples, _ = load_dataset(DataConfig(spec.dataset, max_tokens=max_tokens),
                                       facts.tokenizer)
        path = write_standin_adapter(facts.model_config, config.lora, config.seed,
                                     facts.model_path)
        try:
            worker.deltaserve_reserve_adapter(TRAIN_ADAPTER_NAME, TRAIN_ADAPTER_ID, path)
        finally:
            shutil.rmtree(path, ignore_errors=True)
        link.idle_wait_s = IDLE_WAIT_S
        link.remote = {"state": "calibrating", "samples": len(samples)}

        def start(model: LatencyModel) -> None:
            try:
                cap = uninterruptible_cap(model, config.slo.ttft_s,
                                          config.admission.max_ft_tokens_per_step)
                cfg = replace(config, admission=replace(config.admission,
                                                        max_ft_tokens_per_step=cap))
                start_coserver(link, facts, cfg, samples, model)
                link.remote = {"state": "coserving", "samples": len(samples),
                               "max_ft_tokens_per_step": cap}
            except Exception:
                link.remote = {"state": "failed", "error": traceback.format_exc()}

        if spec.latency_model:
            start(LatencyModel.load(spec.latency_model))
        else:
            cal = QUICK_CALIBRATION if spec.calibration == "quick" else None
            link.calibration = new_calibration(
                link, facts, cal, config.latency, config.seed,
                on_done=lambda run: start(run.model))
    except Exception:
        link.remote = {"state": "failed", "error": traceback.format_exc()}
    return remote_status(worker)


def uninterruptible_cap(model: LatencyModel, ttft_s: float, cap: int) -> int:
    """The most fine-tuning tokens (at most ``cap``, at least 1) whose training-only step the
    latency model prices within :data:`UNINTERRUPTIBLE_TTFT_SHARE` of ``ttft_s``."""
    limit = UNINTERRUPTIBLE_TTFT_SHARE * ttft_s
    lo, hi = 1, cap
    while lo < hi:  # the predicted time grows with the token count
        mid = (lo + hi + 1) // 2
        if model.predict_upper(StepShape(ft_lens=(mid,))) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def remote_status(worker: Any) -> dict[str, Any]:
    link = registry.link_for(worker.vllm_config)
    status = dict(getattr(link, "remote", None) or {"state": "detached"})
    run = link.calibration
    if run is not None and not run.done:
        status["calibration"] = {"probes": len(run.plan), "points": run.points}
    co = link.coserver
    if co is not None:
        s = co.stats()
        status.update(optimizer_steps=s.optimizer_steps, ft_tokens_committed=s.ft_tokens_committed,
                      ft_tokens_forwarded=s.ft_tokens_forwarded, last_loss=s.last_loss,
                      epoch=s.epoch)
    return status


def remote_detach(worker: Any, drain: bool, checkpoint: bool) -> dict[str, Any]:
    link = registry.link_for(worker.vllm_config)
    link.calibration = None
    co, link.coserver = link.coserver, None
    if co is None:
        return {"state": "detached"}
    co.close(drain=drain, checkpoint=checkpoint)
    stats = co.stats()
    root = co.config.checkpoint.root
    latest = find_latest(root) if checkpoint and root else None
    link.remote = {"state": "detached"}
    return {"state": "detached", "optimizer_steps": stats.optimizer_steps,
            "ft_tokens_committed": stats.ft_tokens_committed,
            "checkpoint": str(latest) if latest else None}
