"""Hidden requests: work DeltaServe's scheduler adds to SGLang's own queue that no client sees.

A training sample becomes a prefill-only request: its tokens as the prompt, ``max_new_tokens=1``
(one forward of the whole prompt; the one sampled token is thrown away), greedy, on the reserved
training adapter's ``lora_id``. It enters through ``Scheduler.handle_generate_request``, the
same path as every client request, so SGLang validates it, queues it behind the clients already
waiting and batches it as it batches any prefill. Each carries an ``extra_key`` unique to it:
SGLang's radix cache keys prefixes by ``(lora_id, extra_key)``, so a sample never matches
anyone's cached prefix (it is prefilled whole, every row computed and captured) and nobody ever
matches its KV.

Its output never leaves the scheduler process: :class:`HiddenFilteringStreamer`, the output
streamer the scheduler subclass hands SGLang (``Scheduler.get_output_streamer_class``, SGLang's
factory method for it), drops hidden requests from every batch it streams to the detokenizer.
Hidden requests are recognised by membership in :class:`HiddenRequests`, never by their id's
prefix alone: a client may choose any request id.
"""

from __future__ import annotations

import itertools
import uuid
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper
from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome
from sglang.srt.sampling.sampling_params import SamplingParams

PREFIX = "deltaserve-hidden-"


class HiddenRequests:
    """Creates and tracks the hidden requests of one scheduler."""

    def __init__(self, scheduler: Any):
        self._sched = scheduler
        self._ids = itertools.count()
        # a per-engine token: no client id can collide, even one that copies the prefix
        self._prefix = f"{PREFIX}{uuid.uuid4().hex[:8]}-"
        self.ids: set[str] = set()

    def add(self, token_ids: Sequence[int], *, lora_id: str | None, max_new_tokens: int = 1,
            cache_key: str | None = None) -> str:
        """Queue one hidden request (at the end of SGLang's waiting queue) and return its id.
        ``cache_key``: the radix-cache namespace it shares KV prefixes in (default: its own, so
        it matches nothing and nothing matches it)."""
        # the "." ends the number: SGLang aborts every request whose id starts with the one
        # named (AbortReq), and "-1." is no prefix of "-10."
        rid = f"{self._prefix}{next(self._ids)}."
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                ignore_eos=True)
        params.normalize(None)
        params.verify(self._sched.model_config.vocab_size)
        req = TokenizedGenerateReqInput(
            rid=rid, input_text=None, input_ids=array("q", token_ids), input_embeds=None,
            mm_inputs=None, token_type_ids=None, sampling_params=params, return_logprob=False,
            logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False,
            lora_id=lora_id, extra_key=cache_key or rid, no_logs=True)
        self.ids.add(rid)
        self._sched.handle_generate_request(req)
        return rid

    def __contains__(self, rid: str) -> bool:
        return rid in self.ids

    def live(self) -> list[str]:
        """Hidden requests still waiting or running."""
        live = {r.rid for r in self._sched.waiting_queue}
        live.update(r.rid for r in self._sched.running_batch.reqs)
        return [r for r in self.ids if r in live]

    def withdraw(self, rids: Iterable[str]) -> list[str]:
        """Take those of ``rids`` still waiting out of SGLang's queue (they hold no KV yet:
        SGLang allocates at batch building) and forget them; returns the ones taken."""
        gone = set(rids)
        queue = self._sched.waiting_queue
        taken = [r for r in queue if r.rid in gone]
        if taken:
            self._sched.waiting_queue = [r for r in queue if r.rid not in gone]
            for req in taken:
                self._sched.tree_cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)
        self.forget(r.rid for r in taken)
        return [r.rid for r in taken]

    def forget(self, rids: Iterable[str]) -> None:
        """Stop tracking finished hidden requests (their outputs were already filtered)."""
        self.ids.difference_update(rids)


class CountingSender(SenderWrapper):
    """SGLang's sender to the detokenizer, counting the messages it sent: whoever reads the
    other end knows when it has every message of a step (ZMQ hands them over asynchronously)."""

    def __init__(self, socket: Any):
        super().__init__(socket)
        self.num_sent = 0

    def send_output(self, output: Any, recv_obj: object | None = None) -> None:
        super().send_output(output, recv_obj)
        if self.socket is not None:
            self.num_sent += 1


class HiddenFilteringStreamer(SchedulerOutputStreamer):
    """SGLang's output streamer, minus hidden requests: the one place SGLang turns finished or
    streamed requests into messages for the detokenizer (and from there the client). It sends
    through a :class:`CountingSender`."""

    hidden: HiddenRequests | None = None  # set per scheduler by the subclass's factory

    def __post_init__(self) -> None:
        super().__post_init__()
        self.send_to_detokenizer = CountingSender(self.send_to_detokenizer.socket)

    @property
    def num_sent(self) -> int:
        """Messages streamed to the detokenizer so far."""
        return self.send_to_detokenizer.num_sent

    def stream_output(self, reqs: list[Any], return_logprob: bool, skip_req: Any = None):
        hidden = self.hidden
        if hidden is not None and hidden.ids:
            done = [r.rid for r in reqs if r.rid in hidden and r.finished()]
            reqs = [r for r in reqs if r.rid not in hidden]
            hidden.forget(done)
            if not reqs:
                return None
        return super().stream_output(reqs, return_logprob, skip_req)


def streamer_class(hidden: HiddenRequests) -> type[SchedulerOutputStreamer]:
    """A :class:`HiddenFilteringStreamer` subclass bound to one scheduler's hidden requests
    (SGLang's streamer is a slotted dataclass built by SGLang, so the binding is a class
    attribute of a per-scheduler subclass rather than an instance field)."""
    return type("DeltaServeOutputStreamer", (HiddenFilteringStreamer,), {"hidden": hidden})
