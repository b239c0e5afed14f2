"""``CoServingScheduler``: SGLang's ``Scheduler`` with the co-server's step protocol inside it.

SGLang runs its scheduler and model runner in one process (the scheduler calls its TP worker's
model runner directly when the overlap schedule is off), so the co-server lives there too: in
the caller's process (:class:`~deltaserve.hosts.sglang.runtime.InProcessRuntime`), or in the
scheduler process SGLang spawns, where DeltaServe's plugin replaces SGLang's ``Scheduler`` with
this class (``HookRegistry`` ``REPLACE``). Per step, through overrides of ``Scheduler`` methods:

1. ``get_next_batch_to_run``: the :class:`SchedulingView` of the step SGLang is about to
   choose (:mod:`.view`), ``co.plan(view)``, the step's rows queued as hidden prefill-only
   requests on the training adapter behind every client (:mod:`.hidden`), then SGLang's own
   choice; rows SGLang did not take are withdrawn.
2. ``run_batch``: the forward hooks armed with the step (:mod:`.hooks`: capture every layer's
   input of the training rows, ask ``should_abort`` at every layer boundary), the step timed,
   and exactly one ``co.observe(StepReport(...))``: ``aborted`` unless every row ran whole.
   A plan whose step SGLang did not run at all is observed as an empty, aborted step.
3. ``process_batch_result``: the step's tokens stamped on the client clock, then the step's
   record, its span timed from the entry of ``get_next_batch_to_run`` (SGLang's scheduling, the
   yield, the forward and the output handling; what SGLang's loop does outside these calls is
   time between the spans).
4. ``handle_generate_request``: a client's arrival time, and ``co.on_arrival()``.

Hidden requests never reach a client: ``get_output_streamer_class`` returns a streamer that
drops them, and ``get_prefill_adder_class`` an adder that never chunks a training request (a
sample is prefilled whole in one step or not at all). Supports the normal (non-overlapped)
event loop only: with the overlap schedule the next batch is prepared while the previous
forward runs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sglang
import torch
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
from sglang.srt.managers.scheduler import Scheduler

from deltaserve.core.calibration import Batching, HostLimits
from deltaserve.core.contract import CoServingHooks, StepReport, TrainingStep, plan_after_yield
from deltaserve.core.errors import InputError
from deltaserve.core.shape import StepShape
from deltaserve.hosts.sglang.hidden import HiddenRequests, streamer_class
from deltaserve.hosts.sglang.hooks import ArmedStep, ForwardHooks, ForwardRecord, row_index
from deltaserve.hosts.sglang.version import check_version
from deltaserve.hosts.sglang.view import ClientClock, batch_shape, proposed_view

logger = logging.getLogger("deltaserve.sglang")

# (shape that ran, seconds, fine-tuning tokens, aborted, span seconds: StepRecord.span_s) of
# every executed step
StepListener = Callable[[StepShape, float, int, bool, float], None]


@dataclass(frozen=True)
class _Planned:
    """A planned step on its way to ``run_batch``: the co-server that planned it, the step and
    the hidden requests carrying its rows (in row order)."""

    co: CoServingHooks
    step: TrainingStep
    rids: tuple[str, ...]


@dataclass(frozen=True)
class _Ran:
    """An executed step on its way to its record after SGLang handled its output."""

    shape: StepShape
    seconds: float
    ft_tokens: int
    aborted: bool


def _adder_class(whole: set[str]) -> type[PrefillAdder]:
    class WholeSampleAdder(PrefillAdder):
        """SGLang's prefill adder, except that a training request (``whole``) that does not fit
        the step's remaining token budget whole is not taken (SGLang would chunk it)."""

        def add_one_req(self, req: Any, has_chunked_req: bool, truncation_align_size: Any):
            if req.rid in whole:
                n = self.ceil_paged_tokens(len(req.full_untruncated_fill_ids) - req.prefix_len)
                chunk = self.rem_chunk_tokens
                if n > self.rem_input_tokens or (chunk is not None and n > chunk):
                    return AddReqResult.OTHER
            return super().add_one_req(req, has_chunked_req, truncation_align_size)

    return WholeSampleAdder


class CoServingScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any):
        check_version(str(sglang.__version__))
        # needed while Scheduler.__init__ builds its output streamer
        self.deltaserve_hidden = HiddenRequests(self)
        self._whole: set[str] = set()  # the training requests of the step being built
        super().__init__(*args, **kwargs)
        if self.enable_overlap:
            raise InputError("disable_overlap_schedule", False, "DeltaServe observes each step "
                             "before the next is planned; pass disable_overlap_schedule=True")
        self.deltaserve_hooks = ForwardHooks(self.tp_worker.model_runner.model,
                                             self._probe_arrivals)
        self.deltaserve_hooks.install()
        self.deltaserve_clock = ClientClock()
        self.deltaserve_co: CoServingHooks | None = None
        self.deltaserve_train_lora_id: str | None = None
        self.deltaserve_listener: StepListener | None = None
        # set on a client arrival: ends a yield to the backward early
        self.deltaserve_wake = threading.Event()
        self._planned: _Planned | None = None
        self._ran: _Ran | None = None
        self._span_t0 = 0.0  # time.perf_counter() at the entry of the step being built
        logger.info("DeltaServe: SGLang runs DeltaServe's scheduler in pid %d (%d decoder "
                    "layers hooked)", os.getpid(), self.deltaserve_hooks.num_layers)

    # ---- SGLang's factories ------------------------------------------------------------------
    def get_output_streamer_class(self) -> type:
        return streamer_class(self.deltaserve_hidden)

    def get_prefill_adder_class(self) -> type[PrefillAdder]:
        return _adder_class(self._whole)

    # ---- clients ----------------------------------------------------------------------------
    def deltaserve_submit(self, recv_req: Any, arrival_s: float) -> None:
        """A client request that arrived at ``arrival_s`` (``time.monotonic()``)."""
        self.deltaserve_clock.arrived(recv_req.rid, arrival_s)
        self.handle_generate_request(recv_req)

    def handle_generate_request(self, recv_req: Any) -> Any:
        if recv_req.rid in self.deltaserve_hidden:
            return super().handle_generate_request(recv_req)
        if recv_req.rid not in self.deltaserve_clock:  # SGLang's own server
            self.deltaserve_clock.arrived(recv_req.rid, time.monotonic())
        if self.deltaserve_co is not None:
            self.deltaserve_co.on_arrival()
        self.deltaserve_wake.set()
        train_id = self.deltaserve_train_lora_id
        if train_id is None or recv_req.lora_id != train_id:
            return super().handle_generate_request(recv_req)
        # A client naming the training adapter's id (SGLang's native API takes a raw
        # lora_id): finished with an error before it runs, on the base model, as SGLang
        # refuses an invalid request (raising here would stop the scheduler).
        recv_req.lora_id = None
        out = super().handle_generate_request(recv_req)
        for req in self.waiting_queue:
            if req.rid == recv_req.rid:
                req.set_finish_with_abort(f"adapter {train_id!r} is reserved for training")
        return out

    def abort_request(self, recv_req: Any) -> Any:
        clock = self.deltaserve_clock
        for rid in [r for r in clock.arrival_s if recv_req.abort_all or
                    r.startswith(recv_req.rid)]:  # SGLang's own matching
            clock.forget(rid)
        return super().abort_request(recv_req)

    def _probe_arrivals(self) -> None:
        """At a layer boundary of a step that may stop: under SGLang's own server, a message
        waiting on the scheduler's input socket is a client arriving (it is read after the
        step); in process, arrivals call ``on_arrival`` themselves."""
        sock, co = self.recv_from_tokenizer, self.deltaserve_co
        if co is not None and sock is not None and sock.poll(0):
            co.on_arrival()

    # ---- one step ---------------------------------------------------------------------------
    def get_next_batch_to_run(self, running_batch: Any, last_batch: Any) -> Any:
        self._span_t0 = time.perf_counter()
        co = self.deltaserve_co
        if co is None:
            return super().get_next_batch_to_run(running_batch, last_batch)
        step = self._plan(co, running_batch, last_batch)
        lora_id = self.deltaserve_train_lora_id
        rids = tuple(self.deltaserve_hidden.add(ids, lora_id=lora_id)
                     for ids in step.rows.token_ids)
        self._whole.update(rids)
        try:
            plan = super().get_next_batch_to_run(running_batch, last_batch)
        finally:
            self._whole.clear()
            self.deltaserve_hidden.withdraw(rids)  # those SGLang did not take
        if plan.batch_to_run is None:
            co.observe(StepReport(step, StepShape(), 0.0, aborted=bool(rids), layers_run=0))
        else:
            self._planned = _Planned(co, step, rids)
        return plan

    def _plan(self, co: CoServingHooks, running_batch: Any, last_batch: Any) -> TrainingStep:
        clock = self.deltaserve_clock
        view = proposed_view(self, running_batch, last_batch, clock, time.monotonic())
        # the view holds every request received so far: only later arrivals end a yield
        self.deltaserve_wake.clear()
        return plan_after_yield(co, view, self.deltaserve_wake, time.monotonic)

    def run_batch(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        planned, self._planned = self._planned, None
        armed = self._arm(batch, planned)
        hooks = self.deltaserve_hooks
        hooks.arm(armed)
        t0 = time.perf_counter()
        try:
            result = super().run_batch(batch, *args, **kwargs)
        finally:
            seconds = time.perf_counter() - t0
            hooks.arm(None)
            self._report(batch, planned, armed, seconds, hooks.take())
        return result

    def _arm(self, batch: Any, planned: _Planned | None) -> ArmedStep | None:
        """The step's rows in ``batch`` if every one is there whole, else None."""
        if planned is None or not planned.rids or not batch.forward_mode.is_extend():
            return None
        rids = [r.rid for r in batch.reqs]
        index = row_index(rids, batch.extend_lens, planned.rids, planned.step.rows.lengths)
        if index is None:
            return None
        only_hidden = all(r in self.deltaserve_hidden for r in rids)
        device = self.tp_worker.model_runner.device
        return ArmedStep(planned.step, torch.tensor(index, dtype=torch.long, device=device),
                         planned.step.abortable and only_hidden)

    def _report(self, batch: Any, planned: _Planned | None, armed: ArmedStep | None,
                seconds: float, fwd: ForwardRecord | None) -> None:
        shape, _ = batch_shape(batch, planned.rids if planned else ())
        whole = armed is not None and not (fwd is not None and fwd.stopped)
        rows = planned.step.rows if planned is not None else None
        if whole and rows is not None:
            shape = shape.with_ft(rows.lengths)
        aborted = rows is not None and rows.num_samples > 0 and not whole
        if planned is not None:
            layers = fwd.layers_run if fwd is not None else None
            planned.co.observe(StepReport(planned.step, shape, seconds, aborted, layers))
        ft = rows.num_tokens if whole and rows is not None else 0
        self._ran = _Ran(shape, seconds, ft, aborted)

    def deltaserve_step(self) -> bool:
        """One iteration of SGLang's normal event loop without receiving from its sockets
        (callers hand requests over). Returns whether a batch ran."""
        plan = self.get_next_batch_to_run(running_batch=self.running_batch,
                                          last_batch=self.last_batch)
        self.running_batch = plan.running_batch
        batch = plan.batch_to_run
        if batch:
            self.process_batch_result(batch, self.run_batch(batch))
        else:
            self.on_idle()
        self.last_batch = batch
        return bool(batch)

    def deltaserve_limits(self) -> HostLimits:
        """What one step can hold, as SGLang sized it (its KV cache may be smaller than asked
        for). SGLang runs a prefill step or a decode step, never both (no mixed chunks)."""
        return HostLimits(min(self.chunked_prefill_size, self.max_prefill_tokens),
                          self.max_running_requests, self.max_req_input_len,
                          self.max_total_num_tokens, Batching.PHASE_SEPARATED)

    def deltaserve_has_unfinished(self) -> bool:
        """Whether any request, client or hidden, is still waiting or running."""
        # a prefill batch joins running_batch at the next step only; finished requests leave
        # it at the next step too
        reqs = list(self.running_batch.reqs) + (self.last_batch.reqs if self.last_batch else [])
        return bool(self.waiting_queue) or self.chunked_req is not None \
            or any(not r.finished() for r in reqs)

    def process_batch_result(self, batch: Any, result: Any) -> Any:
        try:
            out = super().process_batch_result(batch, result)
            self.deltaserve_clock.stepped(batch.reqs, time.monotonic())
        finally:
            ran, self._ran = self._ran, None
            if ran is not None and self.deltaserve_listener is not None:
                span_s = time.perf_counter() - self._span_t0
                self.deltaserve_listener(ran.shape, ran.seconds, ran.ft_tokens, ran.aborted,
                                         span_s)
        return out
