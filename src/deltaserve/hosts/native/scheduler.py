"""Continuous batching with chunked prefill and preemption by recompute.

Each step first gives running requests their next tokens (a decode, or the next chunk of a long
prompt), oldest first, then admits waiting requests first-come first-served while the step's
token budget, the sequence limit and free KV blocks allow. When a running request cannot get a
block, the newest running request is preempted: its blocks are freed and it goes back to the
front of the queue to be recomputed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from deltaserve.hosts.native.block_manager import BlockManager
from deltaserve.hosts.native.request import Request, Status


@dataclass(frozen=True)
class ScheduledItem:
    request: Request
    num_tokens: int  # tokens of this request in the step, from request.num_computed on

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and bool(self.request.output_token_ids) \
            and self.request.num_computed == self.request.num_tokens - 1

    @property
    def completes_prompt(self) -> bool:
        """The step reaches the request's last token, so it samples the next one."""
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


@dataclass(frozen=True)
class ScheduledBatch:
    """Decodes first, then prefill chunks (the row order of the step)."""

    items: tuple[ScheduledItem, ...]
    preempted: tuple[Request, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.items

    @property
    def decodes(self) -> tuple[ScheduledItem, ...]:
        return tuple(i for i in self.items if i.is_decode)

    @property
    def prefills(self) -> tuple[ScheduledItem, ...]:
        return tuple(i for i in self.items if not i.is_decode)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        items: list[ScheduledItem] = []
        preempted: list[Request] = []
        for req in list(self.running):
            if req not in self.running:  # preempted below to make room for an older one
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            if n <= 0:
                continue
            while not self.blocks.can_hold(req, req.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue
            self.blocks.grow(req, req.num_computed + n)
            items.append(ScheduledItem(req, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed, budget)
            if not self.blocks.can_hold(req, req.num_computed + n):
                break
            self.waiting.popleft()
            self.blocks.grow(req, req.num_computed + n)
            req.status = Status.RUNNING
            self.running.append(req)
            items.append(ScheduledItem(req, n))
            budget -= n
        items.sort(key=lambda i: not i.is_decode)  # stable: decodes first, each in order
        return ScheduledBatch(tuple(items), tuple(preempted))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Done or aborted: leave whichever queue it is in and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req.status is Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        self.blocks.free(req)
