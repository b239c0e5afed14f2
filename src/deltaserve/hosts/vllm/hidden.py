"""Hidden requests: work the scheduler subclass adds to vLLM's own queue that no client sees.

A training sample becomes a prefill-only request: its tokens as the prompt, ``max_tokens=1``
(one forward of the whole prompt; the one sampled token is thrown away), the reserved training
adapter, and a cache salt of its own (128 random bits from :mod:`secrets`), so prefix caching
neither shortens the sample (no hit on anyone's blocks) nor lets anyone reuse its blocks or
probe for them: a client would have to guess the salt. Calibration probes are hidden
requests too. Their outputs and finish events are removed before vLLM's output path sees them,
so vLLM reports exactly the client requests as finished.

Hidden requests are recognised by membership in :class:`HiddenRequests`, never by their id's
prefix alone: a client may choose any request id.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Iterable, Sequence
from enum import Enum

from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.request import Request, RequestStatus

PREFIX = "deltaserve-hidden-"
# Under vLLM's priority policy a larger value is served later and preempted first.
_LOWEST_PRIORITY = 2**31 - 1
SALT_BYTES = 16  # a hidden request's cache salt: 128 random bits


def new_salt() -> str:
    """A cache salt no one else can produce (vLLM mixes it into every block hash)."""
    return secrets.token_hex(SALT_BYTES)


class HiddenKind(Enum):
    SAMPLE = "sample"  # a fine-tuning sample on the reserved training adapter
    PROBE = "probe"  # calibration: inference-shaped work (a prefill or a decode stream)
    PROBE_FT = "probe_ft"  # calibration: training-shaped rows on the training adapter


class HiddenRequests:
    """Creates, tracks and retires the hidden requests of one scheduler."""

    def __init__(self, scheduler: Scheduler):
        self._sched = scheduler
        cache = scheduler.cache_config
        # The engine core builds client requests with this same hasher. A request without one
        # crashes vLLM once it fills a block while prefix caching is on.
        self._hasher = (get_request_block_hasher(
            scheduler.hash_block_size, get_hash_fn_by_name(cache.prefix_caching_hash_algo))
            if cache.enable_prefix_caching else None)
        self._priority = _LOWEST_PRIORITY if scheduler.policy is SchedulingPolicy.PRIORITY else 0
        self._ids = itertools.count()
        # a per-engine token, so ids differ across engines; a client may still pick any id, so
        # hidden requests are told apart by membership, never by this prefix
        self._prefix = f"{PREFIX}{secrets.token_hex(4)}-"
        self.kinds: dict[str, HiddenKind] = {}
        # ids retired at the previous update: vLLM may report their finish one step late
        # (finished sets of multi-client engines), so they stay filtered for one more step
        self._retired: set[str] = set()

    def add(self, kind: HiddenKind, token_ids: Sequence[int], *,
            lora_request: LoRARequest | None = None, max_tokens: int = 1, salt: str | None = None,
            ignore_eos: bool = False) -> Request:
        """Queue a hidden request at the *end* of the waiting queue: every client request already
        waiting is scheduled before it. ``salt`` None: a fresh :func:`new_salt` (no prefix
        reuse either way); calibration shares one between the requests of a probe."""
        rid = f"{self._prefix}{kind.value}-{next(self._ids)}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos,
                                detokenize=False)
        req = Request(request_id=rid, prompt_token_ids=list(token_ids), sampling_params=params,
                      pooling_params=None, arrival_time=time.time(), lora_request=lora_request,
                      cache_salt=salt if salt is not None else new_salt(), priority=self._priority,
                      block_hasher=self._hasher)
        self.kinds[rid] = kind
        self._sched.requests[rid] = req
        self._sched.waiting.add_request(req)
        return req

    def kind(self, req_id: str) -> HiddenKind | None:
        return self.kinds.get(req_id)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.kinds

    def abort(self, req_ids: Iterable[str]) -> None:
        """Retire hidden requests now: KV blocks freed, the worker drops their state next step
        (they are forgotten at the next :meth:`filter_outputs`)."""
        live = [r for r in req_ids if r in self.kinds and r in self._sched.requests]
        if live:
            self._sched.finish_requests(live, RequestStatus.FINISHED_ABORTED)

    def live(self) -> list[str]:
        return [r for r in self.kinds if r in self._sched.requests]

    def filter_outputs(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """Drop hidden requests' outputs and finish events (in place); forget retired ones."""
        hidden = set(self.kinds) | self._retired
        for eco in outputs.values():
            eco.outputs = [o for o in eco.outputs if o.request_id not in hidden]
            if eco.finished_requests:
                eco.finished_requests = {r for r in eco.finished_requests if r not in hidden}
        self._retired = {r for r in self.kinds if r not in self._sched.requests}
        for rid in self._retired:
            del self.kinds[rid]
