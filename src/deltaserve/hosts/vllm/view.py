"""vLLM's scheduler state as the co-server sees it: the proposed step, the executed step, and the
SLO state of client requests.

Admission must price the batch *before* vLLM builds it (the samples it admits are queued into
the same ``schedule()`` call), so :func:`propose` replays vLLM's token budgeting over the running
and waiting queues: running requests first (a decode, or the next chunk of a prompt), then
waiting ones in queue order while tokens and sequence slots remain. Prefix-cache hits are not
known before scheduling, so a new prompt counts in full: the estimate can only be too large,
which makes admission conservative and leaves the samples queued behind the clients room to run
whole. The step vLLM actually built is read back exactly from its ``SchedulerOutput``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from vllm.config import VllmConfig
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import PriorityRequestQueue, RequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from deltaserve.core.admission import SchedulingView
from deltaserve.core.shape import ExecMode, StepShape
from deltaserve.core.slo import WaitingRequest
from deltaserve.hosts.vllm.hidden import HiddenKind, HiddenRequests


@dataclass(frozen=True)
class Proposal:
    """The inference batch vLLM is expected to schedule. ``tokens``: request id → tokens."""

    shape: StepShape
    tokens: dict[str, int]


def _is_decode(req: Request, num_computed: int, n: int) -> bool:
    # A request past its prompt generating one token; a recomputed (preempted) one is a prefill.
    return n == 1 and num_computed >= req.num_prompt_tokens and req.num_output_tokens > 0


def _waiting_order(queue: RequestQueue) -> Iterable[Request]:
    reqs = list(queue)
    if isinstance(queue, PriorityRequestQueue):  # a heap: iterate in service order
        reqs.sort(key=lambda r: (r.priority, r.arrival_time))
    return reqs


def propose(sched: Scheduler, hidden: HiddenRequests, mode: ExecMode = ExecMode.EAGER) -> Proposal:
    """Estimate the client batch of the coming ``schedule()`` (see the module docstring)."""
    cfg = sched.scheduler_config
    budget = sched.max_num_scheduled_tokens
    threshold = cfg.long_prefill_token_threshold if len(sched.running) + len(sched.waiting) > 1 \
        else 0
    tokens: dict[str, int] = {}
    prefills: list[int] = []
    decodes = kv = 0
    for req in sched.running:
        if budget <= 0:
            break
        if req.request_id in hidden:
            continue
        n = req.num_tokens_with_spec + req.num_output_placeholders - req.num_computed_tokens
        if 0 < threshold < n:
            n = threshold
        n = min(n, budget, sched.max_model_len - req.num_computed_tokens - 1)
        if n <= 0:
            continue
        tokens[req.request_id] = n
        kv += req.num_computed_tokens
        if _is_decode(req, req.num_computed_tokens, n):
            decodes += 1
        else:
            prefills.append(n)
        budget -= n
    active = len(sched.running)
    for queue in (sched.kv_holding_waiting, sched.waiting):
        for req in _waiting_order(queue):
            if budget <= 0 or active >= sched.max_num_active_reqs:
                break
            if req.request_id in hidden:
                continue
            n = req.num_tokens - req.num_computed_tokens
            if 0 < threshold < n:
                n = threshold
            if n > budget and not cfg.enable_chunked_prefill:
                budget = 0
                break
            n = min(n, budget)
            if n <= 0:
                continue
            tokens[req.request_id] = n
            kv += req.num_computed_tokens
            prefills.append(n)
            budget -= n
            active += 1
    return Proposal(StepShape(tuple(prefills), decodes, kv, mode=mode), tokens)


def scheduling_view(sched: Scheduler, hidden: HiddenRequests, last_token_s: dict[str, float],
                    mode: ExecMode = ExecMode.EAGER, now_s: float | None = None
                    ) -> tuple[SchedulingView, Proposal]:
    """The proposed step and the SLO state of client requests (wall clock, like vLLM's
    ``Request.arrival_time``). ``last_token_s``: time of each request's latest token."""
    now = time.time() if now_s is None else now_s
    prop = propose(sched, hidden, mode)
    pending = [r for r in sched.running if r.num_output_tokens == 0]
    pending += [r for q in (sched.kv_holding_waiting, sched.waiting) for r in q
                if r.num_output_tokens == 0]
    pending = [r for r in pending if r.request_id not in hidden]
    pending.sort(key=lambda r: r.arrival_time)
    waiting, ahead = [], 0
    for r in pending:  # FCFS: a request's first token waits for the prompts ahead of it
        ahead += max(0, r.num_tokens - r.num_computed_tokens - prop.tokens.get(r.request_id, 0))
        waiting.append(WaitingRequest(r.arrival_time, ahead))
    decoding = [last_token_s[r] for r in last_token_s if r in sched.requests]
    return (SchedulingView(prop.shape, now, tuple(waiting), min(decoding) if decoding else None),
            prop)


@dataclass(frozen=True)
class Executed:
    """The step vLLM built: its shape (inference and training rows) and which hidden requests
    it holds, each with ``(tokens before the step, tokens scheduled)``."""

    shape: StepShape
    hidden: dict[str, tuple[int, int]]


def executed(so: SchedulerOutput, sched: Scheduler, hidden: HiddenRequests,
             mode: ExecMode = ExecMode.EAGER) -> Executed:
    """Read the executed step from a ``SchedulerOutput`` (pre-step ``num_computed_tokens``)."""
    prefills: list[int] = []
    ft: list[int] = []
    decodes = kv = 0
    seen: dict[str, tuple[int, int]] = {}
    rows = [(r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs]
    cached = so.scheduled_cached_reqs
    rows += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    for rid, pre in rows:
        n = so.num_scheduled_tokens[rid]
        kind = hidden.kind(rid)
        if kind is not None:
            seen[rid] = (pre, n)
        if kind in (HiddenKind.SAMPLE, HiddenKind.PROBE_FT):
            ft.append(n)
            continue
        req = sched.requests.get(rid)
        kv += pre
        if req is not None and _is_decode(req, pre, n):
            decodes += 1
        else:
            prefills.append(n)
    if ft:
        mode = ExecMode.EAGER  # the contract: a step carrying training rows is eager
    return Executed(StepShape(tuple(prefills), decodes, kv, tuple(ft), mode), seen)


def predict_mode(vllm_config: VllmConfig, shape: StepShape) -> ExecMode:
    """The mode vLLM's CUDA-graph dispatcher is expected to pick for ``shape`` (the worker
    reports the mode it actually used). Graph replay needs a captured size and, for a
    uniform-decode step, a decode graph mode; everything else falls back to its mixed mode."""
    cc = vllm_config.compilation_config
    if vllm_config.model_config.enforce_eager or not cc.cudagraph_mode or shape.ft_lens:
        return ExecMode.EAGER
    if shape.num_tokens > (cc.max_cudagraph_capture_size or 0):
        return ExecMode.EAGER
    wanted = cc.cudagraph_mode.decode_mode() if shape.is_decode_only \
        else cc.cudagraph_mode.mixed_mode()
    return ExecMode.GRAPH if wanted else ExecMode.EAGER
