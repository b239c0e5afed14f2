"""``CoServingScheduler``: vLLM's scheduler with the co-server's step in every ``schedule()``.

Passed to vLLM as ``scheduler_cls``. Per step (vLLM's ``EngineCore.step``):

1. ``schedule()``: estimate the client batch vLLM will build (:func:`view.propose`), lend the
   backward the seconds the SLOs leave before it (:func:`~deltaserve.core.contract.
   plan_after_yield`, where the link has a ``wake`` an arrival sets), take the co-server's
   :class:`~deltaserve.core.contract.TrainingStep` for it (``co.plan``), queue one
   hidden prefill-only request per row sample of ``step.rows`` at the *end* of the waiting
   queue (clients keep priority), then let vLLM schedule. If vLLM did not take every sample
   whole (token budget, KV blocks, ``max_loras``...), the unscheduled requests are aborted now,
   partly scheduled ones after the step, and the step is reported aborted (its samples go back
   to the pool).
2. The forward runs; the worker's hooks (:mod:`.hooks`) call ``step.capture`` for the training
   rows, ask ``step.should_abort`` at every layer boundary and time the forward.
3. ``update_from_output()``: hidden outputs and finish events are removed, and the co-server
   gets one :class:`~deltaserve.core.contract.StepReport` for the step: the executed shape
   with the worker-measured forward time and execution mode.

Every ``plan`` is reported exactly once: a step vLLM never finished (an error in the forward, a
shutdown) is reported aborted before the next one is planned. Requests that name the training
adapter (by vLLM id or name) are refused: finished as aborted before they are ever scheduled,
their client told so in the next step's outputs (as vLLM reports the requests it fails).

Supports vLLM's synchronous scheduling only (the default on CPU): with async scheduling the
next ``schedule()`` runs before the previous ``update_from_output()``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

import vllm
from vllm.config import VllmConfig
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from deltaserve.core.contract import CoServingHooks, StepReport, TrainingStep, plan_after_yield
from deltaserve.core.errors import InputError
from deltaserve.core.shape import StepShape
from deltaserve.hosts.vllm.calibrate import CalibrationRun
from deltaserve.hosts.vllm.hidden import HiddenKind, HiddenRequests
from deltaserve.hosts.vllm.link import EngineLink, ForwardRecord, RowLayout, link_for
from deltaserve.hosts.vllm.train_adapter import TRAIN_ADAPTER_NAME, names_training_adapter
from deltaserve.hosts.vllm.version import check_version
from deltaserve.hosts.vllm.view import Executed, executed, predict_mode, scheduling_view

logger = logging.getLogger("deltaserve.vllm")


@dataclass
class _Dispatched:
    """What ``schedule()`` handed to the executor, for ``update_from_output()``. ``co``: the
    co-server that planned ``step``; ``req_ids``: the step's hidden requests; ``whole``: vLLM
    scheduled each of them in full; ``leftover``: partly scheduled ones, retired after the
    step."""

    executed: Executed
    t_s: float  # time.perf_counter() when schedule() returned
    began_s: float  # time.perf_counter() when schedule() was called
    co: CoServingHooks | None = None
    step: TrainingStep | None = None
    req_ids: tuple[str, ...] = ()
    whole: bool = True
    leftover: tuple[str, ...] = ()
    calibration: CalibrationRun | None = None


@dataclass(frozen=True)
class _Measured:
    shape: StepShape
    seconds: float
    aborted: bool
    layers_run: int | None


class CoServingScheduler(Scheduler):
    def __init__(self, vllm_config: VllmConfig, *args: object, **kwargs: object):
        check_version(str(vllm.__version__))
        super().__init__(vllm_config, *args, **kwargs)
        if self.vllm_config.scheduler_config.async_scheduling:
            raise InputError("async_scheduling", True, "DeltaServe's scheduler observes each "
                             "step before the next is scheduled; pass async_scheduling=False")
        self.hidden = HiddenRequests(self)
        self.link: EngineLink = link_for(self.vllm_config)
        self.link.scheduler = self
        self._last_token_s: dict[str, float] = {}
        # Set when vLLM aborts everything (engine shutdown, or a pause in abort mode): an idle
        # engine stops stepping for training until a client request arrives or it is unpaused,
        # so vLLM's "no work left" shutdown condition can be met.
        self._halted = False
        self._dispatched: _Dispatched | None = None
        self._refused: list[tuple[int, EngineCoreOutput]] = []  # (client, final output)
        self._warned_mlp = False

    # ---- arrivals ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        super().add_request(request)
        if request.request_id not in self.hidden and names_training_adapter(request.lora_request):
            self._refuse(request)
            return
        self._halted = False
        co = self.link.coserver
        if co is not None:
            co.on_arrival()

    def _refuse(self, request: Request) -> None:
        """Finish a request on the training adapter before it runs (raising here would stop
        vLLM's engine); its client gets an empty output, finish reason ``abort``."""
        logger.warning("request %s names the reserved training adapter (%s, id %d); refused",
                       request.request_id, TRAIN_ADAPTER_NAME,
                       request.lora_request.lora_int_id if request.lora_request else -1)
        self.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
        self._refused.append((request.client_index, EngineCoreOutput(
            request.request_id, [], finish_reason=request.get_finished_reason())))

    # ---- the engine loop keeps stepping while training or calibration has work ---------------
    def has_requests(self) -> bool:
        if super().has_requests():
            return True
        link = self.link
        if self._halted or self._pause_state != PauseState.UNPAUSED:
            return False
        if link.calibration is not None and not link.calibration.done:
            return True
        return link.coserver is not None and link.coserver.wants_step()

    def has_client_work(self) -> bool:
        """Whether vLLM holds requests of its own (clients', or calibration probes')."""
        return super().has_requests()

    def set_pause_state(self, pause_state: PauseState) -> None:
        super().set_pause_state(pause_state)
        if pause_state == PauseState.UNPAUSED:
            self._halted = False

    def shutdown(self) -> None:
        """The engine is going away: settle the step in flight, then let whoever attached the
        co-server detach it (captured samples back to the pool, a checkpoint written)."""
        self._settle_unobserved()
        self.link.calibration = None
        if self.link.on_shutdown is not None:
            self.link.on_shutdown()
        super().shutdown()

    # ---- schedule ---------------------------------------------------------------------------
    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        began_s = time.perf_counter()
        self._settle_unobserved()
        link = self.link
        link.rows = None
        cal = link.calibration
        if cal is not None and not cal.done:
            cal.before_schedule(self, self.hidden)
            so = super().schedule(throttle_prefills)
            ex = self._executed(so)
            link.rows = cal.rows_for(ex)
            self._dispatched = _Dispatched(ex, time.perf_counter(), began_s, calibration=cal)
            return so
        co = link.coserver
        if co is None:
            so = super().schedule(throttle_prefills)
            self._dispatched = _Dispatched(self._executed(so), time.perf_counter(), began_s)
            return so
        return self._schedule_with(co, throttle_prefills, began_s)

    def _schedule_with(self, co: CoServingHooks, throttle_prefills: bool,
                       began_s: float) -> SchedulerOutput:
        view, _ = scheduling_view(self, self.hidden, self._last_token_s)
        view = replace(view, proposed=self._with_mode(view.proposed))
        wake = self.link.wake
        # the yield runs here, on the engine's thread before vLLM builds the batch: the
        # co-server and its backward's grant live in this process (see EngineLink.wake)
        step = co.plan(view) if wake is None else plan_after_yield(co, view, wake, time.time)
        ids = self._queue(step)
        so = super().schedule(throttle_prefills)
        ex = self._executed(so)
        lengths = step.rows.lengths
        d = _Dispatched(ex, 0.0, began_s, co, step, ids)
        d.whole = len(ids) == len(lengths) and all(
            ex.hidden.get(rid) == (0, n) for rid, n in zip(ids, lengths, strict=True))
        if lengths and not d.whole:
            # Give the step's samples back: unscheduled requests leave the queue now; requests
            # in this step run (vLLM already placed them) and are retired after it.
            self.hidden.abort([r for r in ids if r not in ex.hidden])
            d.leftover = tuple(r for r in ids if r in ex.hidden)
        elif lengths:
            self.link.rows = RowLayout(step, ids)
        d.t_s = time.perf_counter()
        self._dispatched = d
        return so

    def _queue(self, step: TrainingStep) -> tuple[str, ...]:
        """One hidden request per sample of ``step.rows``, on the training adapter (applied by
        vLLM's LoRA or by the worker's hooks: :attr:`EngineLink.sample_lora`)."""
        rows, lora = step.rows, self.link.train_lora
        if not rows.num_samples:
            return ()
        if step.saves_mlp or lora is None:
            if not self._warned_mlp:  # the step is reported aborted; its samples stay pooled
                logger.error("the vLLM host captures the residual stream only (buffer_save="
                             "residual) and needs the training adapter reserved; training "
                             "rows are not run")
                self._warned_mlp = True
            return ()
        return tuple(self.hidden.add(HiddenKind.SAMPLE, ids,
                                     lora_request=self.link.sample_lora).request_id
                     for ids in rows.token_ids)

    def _with_mode(self, shape: StepShape) -> StepShape:
        return replace(shape, mode=predict_mode(self.vllm_config, shape))

    def _executed(self, so: SchedulerOutput) -> Executed:
        ex = executed(so, self, self.hidden)
        return replace(ex, shape=self._with_mode(ex.shape))

    # ---- after the step ---------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput
                           ) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self.hidden.filter_outputs(outputs)
        for client, out in self._refused:
            outputs.setdefault(client, EngineCoreOutputs()).outputs.append(out)
        self._refused.clear()
        now = time.time()
        for eco in outputs.values():
            for out in eco.outputs:
                if out.finish_reason is not None:
                    self._last_token_s.pop(out.request_id, None)
                elif out.new_token_ids:
                    self._last_token_s[out.request_id] = now
        ran = self._observe(self.link.take_forward())
        co = self.link.coserver
        if not ran and co is not None and self.link.idle_wait_s > 0 \
                and not self.has_client_work():
            co.idle(self.link.idle_wait_s)  # an idle engine lends the machine to the backward
        return outputs

    def finish_requests(self, request_ids: str | Iterable[str] | None,
                        finished_status: RequestStatus) -> list[Request]:
        if request_ids is None:  # everything: vLLM is shutting down or pausing
            self._halted = True
            self._last_token_s.clear()
        else:
            for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
                self._last_token_s.pop(rid, None)
        return super().finish_requests(request_ids, finished_status)

    def _observe(self, fwd: ForwardRecord | None) -> bool:
        """Report the dispatched step; whether it ran anything."""
        d, self._dispatched = self._dispatched, None
        layout, self.link.rows = self.link.rows, None
        if d is None:
            return False
        m = _measure(d, fwd)
        if d.calibration is not None:
            d.calibration.after_step(m.shape, m.seconds)
            return not m.shape.is_empty
        if d.co is not None and d.step is not None:
            self._report(d, layout, m)
        if m.shape.is_empty:
            return False
        self.link.steps += 1
        if self.link.on_step is not None:
            ft = m.shape.num_ft_tokens if d.step is not None else 0
            self.link.on_step(m.shape, m.seconds, ft, m.aborted, time.perf_counter() - d.began_s)
        return True

    def _report(self, d: _Dispatched, layout: RowLayout | None, m: _Measured) -> None:
        assert d.co is not None and d.step is not None
        void = bool(d.step.rows.num_samples) and (
            not d.whole or layout is None or not layout.valid)
        if void:  # the samples did not run whole, or were not captured: back to the pool
            self.hidden.abort(d.leftover or [r for r in d.req_ids if r in self.requests])
        d.co.observe(StepReport(d.step, m.shape, m.seconds, m.aborted or void, m.layers_run))

    def _settle_unobserved(self) -> None:
        """A dispatched step whose output never came back (the forward raised, or the engine
        stops): report it aborted now, so its samples return to the pool exactly once."""
        d, self._dispatched = self._dispatched, None
        self.link.rows = None
        self.link.last_forward = None
        if d is None or d.co is None or d.step is None:
            return
        self.hidden.abort(d.req_ids)
        d.co.observe(StepReport(d.step, d.executed.shape, 0.0, True, 0))


def _measure(d: _Dispatched, fwd: ForwardRecord | None) -> _Measured:
    """The executed shape (in the mode the worker saw) and its forward time. No hook ran: an
    empty step, or a CUDA-graph replay (Python hooks never run inside one); then the step is
    timed from the scheduler's side (synchronous scheduling)."""
    shape = d.executed.shape
    if fwd is None:
        return _Measured(shape, time.perf_counter() - d.t_s, False, None)
    if not shape.ft_lens and fwd.mode is not shape.mode:
        shape = replace(shape, mode=fwd.mode)  # the dispatcher's actual decision
    return _Measured(shape, fwd.seconds, fwd.aborted, fwd.layers_run)
