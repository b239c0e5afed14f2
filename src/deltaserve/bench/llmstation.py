"""The LLMStation baseline (He et al., USENIX ATC '25), as an admission policy on the same host.

What it keeps from the paper: fine-tuning is suspended in iterations that carry prefills and is
fused only into decode iterations (and idle ones); the amount admitted into a decode iteration
is the largest that a per-shape latency lookup says keeps the iteration within the decode
objective, which its authors advise setting slightly below the TPOT target (here 0.9×). The
lookup is a cache of runtime records keyed by (decode batch size, fine-tuning input length),
falling back to profiling results and then to a linear model; like the original, the key holds
neither the KV length nor graph vs eager execution, and the TTFT of queued requests plays no
part in the decision. Backward work runs beside decode iterations (DeltaServe's backward
process with the grant held during prefills stands in for its preemptible autograd tasklets).
"""

from __future__ import annotations

import math

from deltaserve.core.admission import AdmissionPlan, AdmissionScheduler, SchedulingView, Skip
from deltaserve.core.shape import StepShape
from deltaserve.core.slo import NO_LOOKAHEAD, Lookahead

BUCKET_TOKENS = 32  # fine-tuning lengths are bucketed in the cache key
PROFILE_KV_PER_DECODE = 256  # the context the profile was taken at; the key ignores the real one
DECODE_SLO_FRACTION = 0.9


def _bucket(tokens: int) -> int:
    return -(-tokens // BUCKET_TOKENS) * BUCKET_TOKENS


class LLMStationScheduler(AdmissionScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cache: dict[tuple[int, int], float] = {}

    def lookup_s(self, num_decode: int, ft_tokens: int) -> float:
        key = (num_decode, _bucket(ft_tokens))
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        # profiling result / linear model at the profiled context length, no safety margin
        shape = StepShape(num_decode=num_decode, kv_tokens=num_decode * PROFILE_KV_PER_DECODE,
                          ft_lens=(key[1],) if key[1] else ())
        return self.model.predict(shape)

    def yield_budget_s(self, view: SchedulingView, *, ahead: Lookahead = NO_LOOKAHEAD) -> float:
        """Backward tasklets run beside decode iterations while the decode objective allows,
        priced by the same lookup; queued requests' TTFT is not considered."""
        p = view.proposed
        if p.prefill_lens or not p.num_decode or view.oldest_decode_token_s is None:
            return 0.0
        elapsed = view.now_s - view.oldest_decode_token_s
        return DECODE_SLO_FRACTION * self.slo.tpot_s - elapsed - self.lookup_s(p.num_decode, 0)

    def observe(self, shape: StepShape, seconds: float) -> None:
        if shape.ft_lens and not shape.prefill_lens:
            self.cache[(shape.num_decode, _bucket(shape.num_ft_tokens))] = seconds

    def plan(self, view: SchedulingView, *, backward_running: bool = False,
             batch_room_tokens: int | None = None, reserve_s: float = 0.0,
             ahead: Lookahead = NO_LOOKAHEAD) -> AdmissionPlan:
        # LLMStation prices by its own lookup: DeltaServe's yield reserve and lookahead
        # (reserve_s, ahead) play no part
        proposed = view.proposed
        skip = self._precheck(view, backward_running)
        if skip is None and proposed.prefill_lens:
            skip = Skip.INFERENCE_PRESENT  # prefill iterations suspend fine-tuning
        if skip is None and batch_room_tokens is not None and batch_room_tokens <= 0:
            skip = Skip.BUFFER_FULL
        if skip is not None:
            return AdmissionPlan((), proposed, None, math.nan, skip)
        b = proposed.num_decode
        limit_s = DECODE_SLO_FRACTION * self.slo.tpot_s if b else math.inf
        room = min(self.limits.max_tokens_per_step - proposed.num_tokens,
                   self.config.max_ft_tokens_per_step, self.ledger.largest_free_run)
        batch_room = math.inf if batch_room_tokens is None else batch_room_tokens
        lens: list[int] = []
        tok, cost, stop = 0, 0.0, Skip.POOL_EMPTY
        for _, n in self.pool.iter_available():
            if tok >= batch_room:
                stop = Skip.BUFFER_FULL
                break
            if tok + n > room or len(lens) >= self.limits.max_seqs_per_step - b:
                stop = Skip.STEP_LIMIT
                break
            c = self.lookup_s(b, tok + n) if b else 0.0
            if c > limit_s:
                stop = Skip.OVER_BUDGET
                break
            lens.append(n)
            tok, cost = tok + n, c
        if not lens:
            return AdmissionPlan((), proposed, None, math.nan, stop)
        return self._admit(proposed, lens, None, cost, stop)
