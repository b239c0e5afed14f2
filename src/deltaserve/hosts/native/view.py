"""The engine's batch as the co-server sees it: a StepShape and the SLO state of requests."""

from __future__ import annotations

from deltaserve.core.admission import SchedulingView
from deltaserve.core.shape import ExecMode, StepShape
from deltaserve.core.slo import WaitingRequest
from deltaserve.hosts.native.scheduler import ScheduledBatch, Scheduler


def step_shape(batch: ScheduledBatch, mode: ExecMode = ExecMode.EAGER) -> StepShape:
    prefills = batch.prefills
    prefixes = tuple(i.request.num_computed for i in prefills)
    return StepShape(tuple(i.num_tokens for i in prefills), len(batch.decodes),
                     sum(i.request.num_computed for i in batch.items), mode=mode,
                     prefill_prefix_lens=prefixes if any(prefixes) else ())


def scheduling_view(batch: ScheduledBatch, scheduler: Scheduler, now_s: float,
                    mode: ExecMode = ExecMode.EAGER) -> SchedulingView:
    scheduled = {id(i.request): i.num_tokens for i in batch.items}
    pending = [r for r in scheduler.running if not r.token_times_s]
    pending += [r for r in scheduler.waiting if not r.token_times_s]
    pending.sort(key=lambda r: r.arrival_s)
    waiting, ahead = [], 0
    for r in pending:  # FCFS: a request's first token waits for the prompts ahead of it
        ahead += r.num_tokens - r.num_computed - scheduled.get(id(r), 0)
        waiting.append(WaitingRequest(r.arrival_s, ahead))
    last = [r.last_token_s for r in scheduler.running if r.token_times_s]
    last += [r.last_token_s for r in scheduler.waiting if r.token_times_s]  # preempted
    return SchedulingView(step_shape(batch, mode), now_s, tuple(waiting),
                          min(last) if last else None)
