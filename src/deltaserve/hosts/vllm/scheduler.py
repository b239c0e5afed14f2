"""``CoServingScheduler``: vLLM's scheduler with the co-server's admission in every step.

Passed to vLLM as ``scheduler_cls``. Per step (vLLM's ``EngineCore.step``):

1. ``schedule()``: estimate the client batch vLLM will build (:func:`view.propose`), let the
   co-server run Algorithm 1 on it, queue one hidden prefill-only request per admitted sample
   at the *end* of the waiting queue (clients keep priority), then let vLLM schedule. If vLLM did
   not take every sample whole (token budget, KV blocks, ``max_loras``...), the step's samples
   are given back: the unscheduled requests are aborted now, partly scheduled ones after the
   step, and the co-server is told the step was aborted so the samples return to the pool.
2. The forward runs; the worker extension captures the training rows and times the forward.
3. ``update_from_output()``: hidden outputs and finish events are removed, and the co-server
   observes the executed shape with the worker-measured forward time and execution mode.

Supports vLLM's synchronous scheduling only (the default on CPU): with async scheduling the
next ``schedule()`` runs before the previous ``update_from_output()``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler

from deltaserve.core.admission import AdmissionMode, AdmissionPlan
from deltaserve.core.contract import StepRecord, StepReport
from deltaserve.core.errors import InputError
from deltaserve.hosts.vllm import registry
from deltaserve.hosts.vllm.hidden import HiddenKind, HiddenRequests
from deltaserve.hosts.vllm.version import check_version
from deltaserve.hosts.vllm.view import Executed, executed, predict_mode, scheduling_view


@dataclass
class _Dispatched:
    """What ``schedule()`` handed to the executor, for ``update_from_output()``."""

    executed: Executed
    plan: AdmissionPlan | None
    sample_ids: tuple[str, ...]  # hidden requests of the plan's samples, in plan order
    whole: bool  # vLLM scheduled every sample in full in this step
    t_s: float = 0.0  # time.perf_counter() when schedule() returned


class CoServingScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any):
        import vllm

        check_version(str(vllm.__version__))
        super().__init__(*args, **kwargs)
        if self.vllm_config.scheduler_config.async_scheduling:
            raise InputError("async_scheduling", True, "DeltaServe's scheduler observes each "
                             "step before the next is scheduled; pass async_scheduling=False")
        self.hidden = HiddenRequests(self)
        self.link = registry.link_for(self.vllm_config)
        self.link.scheduler = self
        self._last_token_s: dict[str, float] = {}
        # Set when vLLM aborts everything (engine shutdown, or a pause in abort mode): an idle
        # engine stops stepping for training until a client request arrives or it is unpaused,
        # so vLLM's "no work left" shutdown condition can be met.
        self._halted = False
        self._dispatched: _Dispatched | None = None
        self._void: list[str] = []  # hidden requests to abort once the running step is done

    # ---- arrivals ---------------------------------------------------------------------------
    def add_request(self, request: Any) -> None:
        super().add_request(request)
        self._halted = False
        co = self.link.coserver
        if co is not None:
            co.on_arrival()

    # ---- the engine loop keeps stepping while training or calibration has work ---------------
    def has_requests(self) -> bool:
        if super().has_requests():
            return True
        link = self.link
        if self._halted or self._pause_state != PauseState.UNPAUSED:
            return False
        if link.calibration is not None and not link.calibration.done:
            return True
        return link.coserver is not None and _training_wanted(link.coserver)

    def set_pause_state(self, pause_state: Any) -> None:
        super().set_pause_state(pause_state)
        if pause_state == PauseState.UNPAUSED:
            self._halted = False

    def shutdown(self) -> None:
        """The engine is going away: return what was captured but not trained to the pool,
        write a checkpoint of the last committed step, stop the backward process."""
        co, self.link.coserver = self.link.coserver, None
        self.link.calibration = None
        if co is not None:
            co.close(drain=False, checkpoint=True)
        super().shutdown()

    # ---- schedule ---------------------------------------------------------------------------
    def schedule(self, throttle_prefills: bool = False) -> Any:
        link = self.link
        link.rows = None
        cal = link.calibration
        if cal is not None and not cal.done:
            cal.before_schedule(self)
            so = super().schedule(throttle_prefills)
            ex = self._executed(so)
            link.rows = cal.rows_for(ex)
            self._dispatched = _Dispatched(ex, None, (), True, time.perf_counter())
            return so
        co = link.coserver
        if co is None:
            so = super().schedule(throttle_prefills)
            self._dispatched = _Dispatched(self._executed(so), None, (), True,
                                           time.perf_counter())
            return so

        if link.idle_wait_s > 0 and co.backward_busy and not super().has_requests():
            co.idle(timeout_s=link.idle_wait_s)  # an idle engine lends the machine to the backward
        view, _ = scheduling_view(self, self.hidden, self._last_token_s)
        plan = co.plan(replace(view, proposed=self._with_mode(view.proposed)))
        tokens = co.training_tokens(plan)
        ids = [self.hidden.add(HiddenKind.SAMPLE, toks, lora_request=link.train_lora).request_id
               for toks in tokens]
        co.begin_step(plan)
        so = super().schedule(throttle_prefills)
        ex = self._executed(so)
        whole = all(ex.hidden.get(rid) == (0, len(toks))
                    for rid, toks in zip(ids, tokens, strict=True))
        if ids and not whole:
            # Give the step's samples back: unscheduled requests leave the queue now; requests
            # in this step run (vLLM already placed them) and are retired after it.
            self.hidden.abort([r for r in ids if r not in ex.hidden])
            self._void = [r for r in ids if r in ex.hidden]
        elif ids:
            link.rows = registry.TrainingRows(
                tuple(ids), tuple(s.num_tokens for s in plan.samples), co.capture,
                co.should_abort, abortable=not ex.shape.has_inference, plan=plan)
        self._dispatched = _Dispatched(ex, plan, tuple(ids), whole, time.perf_counter())
        return so

    def _with_mode(self, shape: Any) -> Any:
        return replace(shape, mode=predict_mode(self.vllm_config, shape))

    def _executed(self, so: Any) -> Executed:
        ex = executed(so, self, self.hidden)
        return replace(ex, shape=self._with_mode(ex.shape))

    # ---- after the step ---------------------------------------------------------------------
    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self.hidden.filter_outputs(outputs)
        now = time.time()
        for eco in outputs.values():
            for out in eco.outputs:
                if out.finish_reason is not None:
                    self._last_token_s.pop(out.request_id, None)
                elif out.new_token_ids:
                    self._last_token_s[out.request_id] = now
        self._observe(model_runner_output)
        return outputs

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        if request_ids is None:  # everything: vLLM is shutting down or pausing
            self._halted = True
            self._last_token_s.clear()
        else:
            for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
                self._last_token_s.pop(rid, None)
        return super().finish_requests(request_ids, finished_status)

    def _observe(self, model_runner_output: Any) -> None:
        link, d = self.link, self._dispatched
        self._dispatched = None
        rows, link.rows = link.rows, None
        fwd = link.take_forward()
        if d is None:
            return
        shape = d.executed.shape
        if not shape.is_empty:
            link.steps += 1
        if fwd is not None:
            seconds = fwd.seconds
            if not shape.ft_lens and fwd.mode is not shape.mode:
                shape = replace(shape, mode=fwd.mode)  # the dispatcher's actual decision
        else:
            # no hook ran: an empty step, or a CUDA-graph replay (Python hooks never run inside
            # one); time execute + sample from the scheduler's side (synchronous scheduling)
            seconds = time.perf_counter() - d.t_s
        aborted = fwd is not None and fwd.aborted
        layers_run = fwd.layers_run if fwd is not None else None
        if link.calibration is not None and not link.calibration.done:
            link.calibration.after_step(self, shape, seconds, fwd)
            return
        if d.plan is not None and link.coserver is not None:
            void = bool(d.sample_ids) and (not d.whole or rows is None or not rows.valid)
            if void:  # the samples did not run whole, or were not captured: back to the pool
                self.hidden.abort(self._void or [r for r in d.sample_ids if r in self.requests])
                self._void = []
            co = link.coserver
            # (the co-server checkpoints by itself once the last epoch is committed)
            co.observe(StepReport(d.plan, shape, seconds, aborted or void, layers_run))
        elif link.latency_model is not None and not shape.is_empty:
            link.latency_model.observe(shape, seconds)
        if not shape.is_empty and (link.record_steps or link.on_step is not None):
            ft = shape.num_ft_tokens if d.plan is not None else 0
            rec = StepRecord(time.monotonic(), shape, seconds, ft, aborted)
            if link.record_steps:
                link.step_log.append(rec)
            if link.on_step is not None:
                link.on_step(rec)


def _training_wanted(co: Any) -> bool:
    """Whether an idle engine should still step for the co-server: to commit or launch a
    backward, or because a sample could be admitted into a training-only step."""
    if co.has_pending_training:
        return True
    if co.config.admission.mode is AdmissionMode.OFF or not co.latency.is_calibrated:
        return False
    smallest = co.pool.smallest_available()
    return smallest is not None and smallest <= co.ledger.largest_free_run

