"""SGLang's scheduler state as the co-server sees it: the step SGLang will run next, and the SLO
state of its client requests.

SGLang runs a prefill step whenever a prefill can start (the waiting queue, served in arrival
order: ``schedule_policy=fcfs``, or a chunked prompt's next chunk), else a decode step of its
running requests. :func:`proposed_view` predicts that choice before SGLang makes it, the way
its ``PrefillAdder`` decides with no memory pressure: the chunked request first, then waiting
clients in order, each after its cached prefix (matched in SGLang's radix cache, as the adder
does), until the step's token budget (``chunked_prefill_size``) or the running-request limit is
reached, the last prompt chunked. Where SGLang takes less (KV memory, LoRA slots) the
prediction errs high, which only makes admission more careful; every step is then reported with
the shape that really ran (:func:`batch_shape`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from deltaserve.core.admission import SchedulingView
from deltaserve.core.shape import StepShape
from deltaserve.core.slo import WaitingRequest


class ClientClock:
    """Arrival and last-token times (``time.monotonic()``) of the client requests SGLang holds:
    what the SLO slack is computed from. Hidden requests are never entered."""

    def __init__(self) -> None:
        self.arrival_s: dict[str, float] = {}
        self.last_token_s: dict[str, float] = {}

    def arrived(self, rid: str, at_s: float) -> None:
        self.arrival_s[rid] = at_s

    def __contains__(self, rid: str) -> bool:
        return rid in self.arrival_s

    def stepped(self, reqs: Iterable[Any], now_s: float) -> None:
        """A step ran ``reqs``: a client with output has a token at ``now_s``; finished ones
        are forgotten."""
        for req in reqs:
            if req.rid not in self.arrival_s:
                continue
            if req.finished():
                self.forget(req.rid)
            elif req.output_ids:
                self.last_token_s[req.rid] = now_s

    def forget(self, rid: str) -> None:
        self.arrival_s.pop(rid, None)
        self.last_token_s.pop(rid, None)


def _decoding(sched: Any, running_batch: Any, last_batch: Any, clock: ClientClock) -> list[Any]:
    """Client requests that will decode: the running batch, plus last step's prefills that
    SGLang merges into it first (neither finished nor the chunked request)."""
    reqs = list(running_batch.reqs)
    if last_batch is not None and last_batch is not running_batch \
            and last_batch.forward_mode.is_extend():
        reqs += last_batch.reqs
    return [r for r in reqs if r.rid in clock and not r.finished() and r is not sched.chunked_req
            and r.output_ids]


def _next_prefill(sched: Any, seats: int, clock: ClientClock) -> list[tuple[Any, int, int]]:
    """(request, new tokens, cached prefix) of each client prompt SGLang's next prefill takes."""
    budget = min(sched.chunked_prefill_size, sched.max_prefill_tokens)
    out: list[tuple[Any, int, int]] = []
    chunked = sched.chunked_req
    if chunked is not None and chunked.rid in clock:
        done = max(chunked.prefix_len, chunked.extend_end)
        n = min(len(chunked.full_untruncated_fill_ids) - done, budget)
        if n > 0:
            out.append((chunked, n, done))
            budget -= n
    for req in sched.waiting_queue:
        if budget <= 0 or seats <= 0 or req.rid not in clock:
            break
        req.init_next_round_input(sched.tree_cache)  # the radix-cache match SGLang makes too
        prefix = req.prefix_len
        n = len(req.full_untruncated_fill_ids) - prefix
        out.append((req, min(n, budget), prefix))
        budget -= n
        seats -= 1
    return out


def proposed_view(sched: Any, running_batch: Any, last_batch: Any, clock: ClientClock,
                  now_s: float) -> SchedulingView:
    decoding = _decoding(sched, running_batch, last_batch, clock)
    decode = StepShape(num_decode=len(decoding),
                       kv_tokens=sum(r.seqlen - 1 for r in decoding)) if decoding else None
    prefill = _next_prefill(sched, sched.max_running_requests - len(decoding), clock)
    if prefill:
        prefixes = tuple(p for _, _, p in prefill)
        proposed = StepShape(tuple(n for _, n, _ in prefill), 0, sum(prefixes),
                             prefill_prefix_lens=prefixes if any(prefixes) else ())
    else:
        proposed = decode or StepShape()
    scheduled = {id(r): n for r, n, _ in prefill}
    pending = ([sched.chunked_req] if sched.chunked_req is not None else []) \
        + list(sched.waiting_queue)
    waiting, ahead = [], 0
    for r in pending:  # FCFS: a request's first token waits for the prompts ahead of it
        if r.rid not in clock or r.output_ids:
            continue
        done = max(r.prefix_len, r.extend_end) if r is sched.chunked_req else r.prefix_len
        ahead += len(r.full_untruncated_fill_ids) - done - scheduled.get(id(r), 0)
        waiting.append(WaitingRequest(clock.arrival_s[r.rid], max(0, ahead)))
    last = [clock.last_token_s[r.rid] for r in decoding if r.rid in clock.last_token_s]
    return SchedulingView(proposed, now_s, tuple(waiting), min(last) if last else None,
                          decode if prefill else None)


def batch_shape(batch: Any, train_ids: Sequence[str]) -> tuple[StepShape, tuple[int, ...]]:
    """The inference shape of the step ``batch`` ran (its mode eager: on the CPU SGLang runs no
    CUDA graphs), and the lengths of the rows of ``train_ids`` it held, in batch order."""
    train = set(train_ids)
    if batch.forward_mode.is_decode():
        reqs = [r for r in batch.reqs if r.rid not in train]
        return StepShape(num_decode=len(reqs), kv_tokens=sum(r.seqlen - 1 for r in reqs)), ()
    lens, prefixes, ft = [], [], []
    for req, n, prefix in zip(batch.reqs, batch.extend_lens, batch.prefix_lens, strict=True):
        if req.rid in train:
            ft.append(n)
        else:
            lens.append(n)
            prefixes.append(prefix)
    shape = StepShape(tuple(lens), 0, sum(prefixes),
                      prefill_prefix_lens=tuple(prefixes) if any(prefixes) else ())
    return shape, tuple(ft)
