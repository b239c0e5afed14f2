"""Co-serving inside the engine-core process of ``deltaserve serve --engine vllm``.

vLLM's OpenAI server runs the engine core in a process of its own; with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` in its environment that process holds the scheduler and the
worker together, so the co-server lives there too, attached by the same
:func:`deltaserve.train.attach.attach` as any host, to :class:`EngineProcessHost`. The API server
reaches it only through the worker extension's RPCs (:class:`ServeSpec` in,
:class:`RemoteStatus` out). Attaching cannot block inside an RPC (the RPC runs on the engine's
busy loop, which must keep stepping to run the calibration), so it is a small state machine:
``calibrating`` → ``coserving`` (or ``failed``), which the API server polls before it accepts
requests.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass, replace
from enum import StrEnum

from vllm.config import VllmConfig

from deltaserve.core.calibration import CalibrationConfig
from deltaserve.core.contract import CoServingHooks
from deltaserve.core.data import DataConfig, TrainingSample, load_dataset
from deltaserve.core.errors import require_choice
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.shape import StepShape
from deltaserve.core.tokenizer import Tokenizer
from deltaserve.hosts.vllm.link import EngineLink
from deltaserve.hosts.vllm.training import DelegatedTraining, EngineTraining
from deltaserve.model.loading import load_tokenizer
from deltaserve.train.attach import attach, detach
from deltaserve.train.checkpoint import find_latest
from deltaserve.train.config import CoServeConfig
from deltaserve.train.coserver import CoServer

logger = logging.getLogger("deltaserve.vllm")

# A sweep small enough to finish in about a minute on a 2-core CPU.
QUICK_CALIBRATION = CalibrationConfig(split_total=128, max_split=4, decode_batches=(1, 4, 16),
                                      decode_kv_lens=(64, 256), ft_totals=(64, 256), repeats=2)
CALIBRATIONS = ("quick", "full")
# Serving engine loop: block up to this long in ``schedule()`` when only the backward is busy.
IDLE_WAIT_S = 0.005
# In the serving process a client request reaches the scheduler only between steps (vLLM's
# input thread queues it for the busy loop), so a training-only step cannot be cut short there:
# such a step may cost at most this share of the TTFT objective (:func:`uninterruptible_cap`).
UNINTERRUPTIBLE_TTFT_SHARE = 0.25


@dataclass(frozen=True)
class ServeSpec:
    """What ``deltaserve serve`` asks the engine process to co-serve. ``data.max_tokens`` is
    lowered to what one engine step holds. ``calibration``: ``quick`` or ``full``, unless
    ``latency_model`` (a fitted model's JSON) is given."""

    coserve: CoServeConfig
    data: DataConfig
    calibration: str = "quick"
    latency_model: str | None = None

    def __post_init__(self) -> None:
        require_choice("finetune_calibration", self.calibration, CALIBRATIONS)


class State(StrEnum):
    DETACHED = "detached"
    CALIBRATING = "calibrating"
    COSERVING = "coserving"
    FAILED = "failed"


@dataclass(frozen=True)
class RemoteStatus:
    """Co-serving in the engine process, as the API server polls it."""

    state: State = State.DETACHED
    samples: int = 0
    max_ft_tokens_per_step: int | None = None
    calibration_points: int = 0
    optimizer_steps: int = 0
    ft_tokens_committed: int = 0
    checkpoint: str | None = None
    error: str | None = None


class EngineProcessHost(DelegatedTraining):
    """The :class:`~deltaserve.core.contract.TrainingHost` inside the engine process: the
    engine's training side, with no client API of its own (vLLM's server is the client side)."""

    def __init__(self, link: EngineLink, vllm_config: VllmConfig):
        self.training = EngineTraining(link, vllm_config)
        self.link = link
        self._tokenizer: Tokenizer = load_tokenizer(self.training.model_path)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    def calibrate(self, *args: object, **kwargs: object) -> LatencyModel:
        raise RuntimeError("the engine process calibrates step by step: RemoteCoServing.begin "
                           "runs EngineTraining.calibration_run in the engine loop")

    def set_coserver(self, co: CoServingHooks | None) -> None:
        self.link.coserver = co

    def has_unfinished(self) -> bool:
        return self.training.scheduler.has_client_work()


class RemoteCoServing:
    """The co-server of one engine process, from ``begin`` to ``detach``."""

    def __init__(self, link: EngineLink, vllm_config: VllmConfig):
        self.link = link
        self.host = EngineProcessHost(link, vllm_config)
        self.co: CoServer | None = None
        self._status = RemoteStatus()
        self._spec: ServeSpec | None = None
        self._samples: list[TrainingSample] = []

    def begin(self, spec: ServeSpec) -> RemoteStatus:
        if self._status.state in (State.CALIBRATING, State.COSERVING):
            return self.status()
        try:
            limits = self.host.limits
            data = replace(spec.data, max_tokens=min(spec.data.max_tokens,
                                                     limits.max_tokens_per_step,
                                                     limits.max_model_len))
            tokenizer = self.host.tokenizer
            assert tokenizer is not None
            self._samples, report = load_dataset(data, tokenizer)
            logger.info("dataset %s: %s", data.path, report.summary())
            self._spec = spec
            self.link.idle_wait_s = IDLE_WAIT_S
            self.link.on_shutdown = self.shutdown
            self._status = RemoteStatus(State.CALIBRATING, len(self._samples))
            if spec.latency_model:
                self._start(LatencyModel.load(spec.latency_model))
            else:
                c = spec.coserve
                self.link.calibration = self.host.training.calibration_run(
                    c.lora, QUICK_CALIBRATION if spec.calibration == "quick" else None,
                    c.latency, seed=c.seed, on_done=self._start)
        except Exception:
            self._status = RemoteStatus(State.FAILED, error=traceback.format_exc())
        return self.status()

    def _start(self, model: LatencyModel) -> None:
        """Calibration done (or a fitted model given): attach the co-server."""
        self.link.calibration = None
        assert self._spec is not None
        try:
            c = self._spec.coserve
            cap = uninterruptible_cap(model, c.slo.ttft_s, c.admission.max_ft_tokens_per_step)
            config = replace(c, admission=replace(c.admission, max_ft_tokens_per_step=cap))
            self.co = attach(self.host, dataset=self._samples, config=config,
                             latency_model=model, progress=False)
            self._status = RemoteStatus(State.COSERVING, len(self._samples), cap)
        except Exception:
            self._status = RemoteStatus(State.FAILED, error=traceback.format_exc())

    def status(self) -> RemoteStatus:
        s = self._status
        run = self.link.calibration
        if run is not None and not run.done:
            s = replace(s, calibration_points=run.points)
        if self.co is not None:
            stats = self.co.stats()
            s = replace(s, optimizer_steps=stats.optimizer_steps,
                        ft_tokens_committed=stats.ft_tokens_committed)
        return s

    def detach(self, *, drain: bool, checkpoint: bool) -> RemoteStatus:
        self.link.calibration = None
        co, self.co = self.co, None
        if co is None:
            return self.status()
        detach(self.host, co, drain=drain, checkpoint=checkpoint)
        stats, root = co.stats(), co.config.checkpoint.root
        latest = find_latest(root) if checkpoint and root else None
        self._status = RemoteStatus(State.DETACHED, optimizer_steps=stats.optimizer_steps,
                                    ft_tokens_committed=stats.ft_tokens_committed,
                                    checkpoint=str(latest) if latest else None)
        return self._status

    def shutdown(self) -> None:
        """vLLM stops the engine: captured samples go back to the pool, the last committed step
        is checkpointed, the backward stops."""
        self.detach(drain=False, checkpoint=True)


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
