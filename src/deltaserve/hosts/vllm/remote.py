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
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace

from vllm.config import VllmConfig

from deltaserve.core.calibration import CalibrationConfig
from deltaserve.core.contract import CoServingHooks
from deltaserve.core.data import DataConfig, TrainingSample, load_dataset
from deltaserve.core.errors import require_choice
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.shape import StepShape
from deltaserve.core.tokenizer import Tokenizer
from deltaserve.hosts.delegated import DelegatedTraining
from deltaserve.hosts.vllm.link import EngineLink
from deltaserve.hosts.vllm.training import EngineTraining
from deltaserve.hosts.vllm.wire import (
    CALIBRATIONS,
    CalibrateSpec,
    JobPoll,
    JobStart,
    RemoteStatus,
    State,
    encode_event,
)
from deltaserve.model.loading import load_tokenizer
from deltaserve.train.attach import attach, detach
from deltaserve.train.checkpoint_store import find_latest
from deltaserve.train.config import CoServeConfig
from deltaserve.train.events import TrainingEvent
from deltaserve.train.facade import CoServer

logger = logging.getLogger("deltaserve.vllm")

# A sweep small enough to finish in about a minute on a 2-core CPU.
QUICK_CALIBRATION = CalibrationConfig(split_total=128, max_split=4, decode_batches=(1, 4, 16),
                                      decode_kv_lens=(64, 256), ft_totals=(64, 256), repeats=2)
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


class EngineProcessHost(DelegatedTraining):
    """The :class:`~deltaserve.core.contract.TrainingHost` inside the engine process: the
    engine's training side, with no client API of its own (vLLM's server is the client side)."""

    training: EngineTraining

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
    """The co-server of one engine process. Two ways in: :meth:`begin` (one dataset for the
    server's lifetime: calibrate, then attach) and the fine-tuning service's :meth:`calibrate`
    once, then :meth:`start_job` / :meth:`poll` / :meth:`detach` per job, every job reusing the
    calibrated latency model (which keeps refitting online while a job co-serves)."""

    def __init__(self, link: EngineLink, vllm_config: VllmConfig):
        self.link = link
        self.host = EngineProcessHost(link, vllm_config)
        self.co: CoServer | None = None
        self.model: LatencyModel | None = None  # the calibrated latency model
        self._status = RemoteStatus()
        self._coserve: CoServeConfig | None = None  # the start-up config (SLO, LoRA shape)
        self._samples: list[TrainingSample] = []
        self._lock = threading.Lock()
        self._events: list[TrainingEvent] = []  # a job's events since the last poll

    # ---- one dataset for the server's lifetime (``--finetune-dataset``) --------------------
    def begin(self, spec: ServeSpec) -> RemoteStatus:
        if self._status.state is not State.DETACHED:
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
            self._calibrate(CalibrateSpec(spec.coserve, spec.calibration, spec.latency_model),
                            len(self._samples), self._attach_dataset)
        except Exception:
            self._status = RemoteStatus(State.FAILED, error=traceback.format_exc())
        return self.status()

    def _attach_dataset(self, model: LatencyModel) -> None:
        """Calibration done (or a fitted model given): attach the co-server."""
        self._ready(model)
        assert self._coserve is not None
        try:
            self._attach(self._coserve, self._samples, [])
        except Exception:
            self._status = RemoteStatus(State.FAILED, error=traceback.format_exc())

    # ---- the fine-tuning service: calibrate once, then one co-server per job ---------------
    def calibrate(self, spec: CalibrateSpec) -> RemoteStatus:
        if self._status.state is State.DETACHED:
            try:
                self._calibrate(spec, 0, self._ready)
            except Exception:
                self._status = RemoteStatus(State.FAILED, error=traceback.format_exc())
        return self.status()

    def start_job(self, job: JobStart) -> RemoteStatus:
        """Attach the job's co-server (``RuntimeError`` unless calibrated and idle; a bad
        sample or checkpoint raises ``InputError``: both reach the caller of the RPC)."""
        if self._status.state is not State.READY or self.model is None:
            raise RuntimeError(f"cannot start a job: co-serving is {self._status.state}")
        with self._lock:
            self._events.clear()
        self._attach(job.config, list(job.samples), list(job.validation))
        return self.status()

    def poll(self) -> JobPoll:
        with self._lock:
            events, self._events = self._events, []
        stats = self.co.stats() if self.co is not None else None
        return JobPoll(self.status(), stats, tuple(encode_event(e) for e in events))

    # ---- shared -----------------------------------------------------------------------------
    def _calibrate(self, spec: CalibrateSpec, samples: int,
                   then: Callable[[LatencyModel], None]) -> None:
        self._coserve = spec.coserve
        self.link.idle_wait_s = IDLE_WAIT_S
        self.link.on_shutdown = self.shutdown
        self._status = RemoteStatus(State.CALIBRATING, samples)
        if spec.latency_model:
            then(LatencyModel.load(spec.latency_model))
            return
        c = spec.coserve
        self.link.calibration = self.host.training.calibration_run(
            c.lora, QUICK_CALIBRATION if spec.calibration == "quick" else None, c.latency,
            seed=c.seed, on_done=then)

    def _ready(self, model: LatencyModel) -> None:
        self.link.calibration = None
        self.model = model
        self._status = RemoteStatus(State.READY)

    def _attach(self, config: CoServeConfig, samples: list[TrainingSample],
                validation: list[TrainingSample]) -> None:
        assert self.model is not None
        cap = uninterruptible_cap(self.model, config.slo.ttft_s,
                                  config.admission.max_ft_tokens_per_step)
        config = replace(config, admission=replace(config.admission,
                                                   max_ft_tokens_per_step=cap))
        co = attach(self.host, dataset=samples, config=config, latency_model=self.model,
                    progress=False, validation=validation or None)
        co.subscribe(self._record)
        self.co = co
        self._status = RemoteStatus(State.COSERVING, len(samples), cap)

    def _record(self, event: TrainingEvent) -> None:
        with self._lock:
            self._events.append(event)

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

    def detach(self, *, drain: bool, checkpoint: bool) -> JobPoll:
        """Detach the co-server (its last events and counters come back); the calibrated
        latency model stays, so the next job can start."""
        self.link.calibration = None
        co, self.co = self.co, None
        if co is None:
            return self.poll()
        detach(self.host, co, drain=drain, checkpoint=checkpoint)
        stats, root = co.stats(), co.config.checkpoint.root
        latest = find_latest(root) if checkpoint and root else None
        self._status = RemoteStatus(State.READY if self.model else State.DETACHED,
                                    optimizer_steps=stats.optimizer_steps,
                                    ft_tokens_committed=stats.ft_tokens_committed,
                                    checkpoint=str(latest) if latest else None)
        poll = self.poll()
        return replace(poll, stats=stats)

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
