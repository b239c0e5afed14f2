"""Admission (Algorithm 1): which fine-tuning samples ride in the step a host is about to run.

No admission while the backward runs, the buffer is full or the pool is empty; on a
phase-separated host, none on a decode-only step; in ``temp`` mode, none beside inference work.
Δ is the tightest SLO slack (see :mod:`deltaserve.core.slo`). If the inference-only batch already
costs more than Δ, nothing is admitted (with ``tpot_slack_spend_fraction`` below 1, Δ counts
only that share of the TPOT slack beyond the inference-only step). Otherwise samples are added in
increasing length while buffer rows remain and the margin-inflated prediction of the mixed step
stays ≤ Δ; the first sample that does not fit ends the step's admission. Admitted samples are
claimed from the pool and hold buffer rows, so nothing is picked twice.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from deltaserve.core.buffer_ledger import BufferLedger, RowSpan
from deltaserve.core.calibration import Batching, HostLimits
from deltaserve.core.errors import coerce_enum, require
from deltaserve.core.latency_model import FtPricer, LatencyModel
from deltaserve.core.pool import SamplePool
from deltaserve.core.shape import StepShape
from deltaserve.core.slo import (
    NO_LOOKAHEAD,
    Lookahead,
    SLOConfig,
    StepBudget,
    WaitingRequest,
    tpot_slack_s,
    ttft_slack_s,
)


class AdmissionMode(StrEnum):
    FULL = "full"  # Algorithm 1 in every step
    TEMP = "temp"  # fine-tuning only in steps with no inference work
    OFF = "off"  # inference only


class Skip(StrEnum):
    """Why a step carries no (more) fine-tuning samples."""

    OFF = "off"
    BACKWARD_RUNNING = "backward_running"
    POOL_EMPTY = "pool_empty"
    BUFFER_FULL = "buffer_full"
    DECODE_ONLY_STEP = "decode_only_step"
    INFERENCE_PRESENT = "inference_present"
    UNCALIBRATED = "uncalibrated"
    BUDGET_EXHAUSTED = "budget_exhausted"  # the inference-only batch already exceeds Δ
    OVER_BUDGET = "over_budget"  # the next sample would push the step past Δ
    STEP_LIMIT = "step_limit"  # the host's per-step token or sequence limit


@dataclass(frozen=True)
class AdmissionConfig:
    """``max_ft_tokens_per_step`` caps the samples of one step; it bounds a training-only step,
    where no request constrains Δ. ``admit_during_backward`` lifts Algorithm 1's first rule (an
    ablation: the buffer then needs room for the next batch while the backward reads this one).
    ``tpot_slack_spend_fraction``: the share of a step's TPOT slack (what the decodes' TPOT
    objective leaves after the step's inference-only prediction) that training may spend, by
    admission or by a yield to the backward; the operator's knob between fine-tuning throughput
    and the requests' end-to-end latency (1: all of it, Algorithm 1; smaller: decodes run that
    much ahead of their objective). TTFT slack is unaffected.
    """

    mode: AdmissionMode = AdmissionMode.FULL
    max_ft_tokens_per_step: int = 1024
    admit_during_backward: bool = False
    tpot_slack_spend_fraction: float = 1.0

    def __post_init__(self) -> None:
        coerce_enum(self, "mode", AdmissionMode)
        require(self.max_ft_tokens_per_step > 0, "max_ft_tokens_per_step",
                self.max_ft_tokens_per_step, "must be > 0")
        require(0.0 < self.tpot_slack_spend_fraction <= 1.0, "tpot_slack_spend_fraction",
                self.tpot_slack_spend_fraction, "must be in (0, 1]")


@dataclass(frozen=True)
class SchedulingView:
    """What a host tells the co-server before it dispatches a step.

    ``waiting``: requests with no first token yet, in scheduling order, including those whose
    prefill is in ``proposed``. ``oldest_decode_token_s``: time of the last token of the decode
    request that has waited longest (None: no decode in flight). ``deferred_decode``: on a
    phase-separated host, the decode step this step delays.
    """

    proposed: StepShape
    now_s: float
    waiting: tuple[WaitingRequest, ...] = ()
    oldest_decode_token_s: float | None = None
    deferred_decode: StepShape | None = None

    @property
    def queued_prompt_tokens(self) -> int:
        """Client prompt tokens not yet processed: those ``proposed`` takes and those after it
        (``tokens_after_step`` counts every request ahead, so the last waiting one holds all)."""
        after = max((w.tokens_after_step for w in self.waiting), default=0)
        return after + sum(self.proposed.prefill_lens)


class AdmittedSample(NamedTuple):
    """One admitted sample and its buffer rows (a NamedTuple for the same reason as RowSpan)."""

    sample_id: int
    num_tokens: int
    rows: RowSpan


@dataclass(frozen=True)
class AdmissionPlan:
    """The step to run: the host's batch plus the admitted samples ``sample_ids`` (in the order
    their rows are laid out in the step; their lengths end ``shape.ft_lens``), whose buffer rows
    are one contiguous run from ``row_start``. ``skip`` says why admission stopped;
    ``predicted_s`` is the margin-inflated prediction of ``shape``.

    The plan stores arrays, not an object per sample, so a decision costs little per admitted
    sample; :attr:`samples` gives the per-sample view.
    """

    sample_ids: tuple[int, ...]
    shape: StepShape
    budget: StepBudget | None
    predicted_s: float
    skip: Skip | None
    row_start: int = 0

    @functools.cached_property
    def samples(self) -> tuple[AdmittedSample, ...]:
        if not self.sample_ids:
            return ()
        lens = self.shape.ft_lens[len(self.shape.ft_lens) - len(self.sample_ids):]
        starts = itertools.accumulate(lens[:-1], initial=self.row_start)
        return tuple(AdmittedSample(sid, n, RowSpan(start, n))
                     for sid, n, start in zip(self.sample_ids, lens, starts, strict=True))

    @property
    def num_ft_tokens(self) -> int:
        return sum(self.shape.ft_lens[len(self.shape.ft_lens) - len(self.sample_ids):])


class AdmissionScheduler:
    """Algorithm 1 over a latency model, a sample pool and the buffer's row ledger."""

    def __init__(self, config: AdmissionConfig, slo: SLOConfig, limits: HostLimits,
                 model: LatencyModel, pool: SamplePool, ledger: BufferLedger):
        self.config = config
        self.slo = slo
        self.limits = limits
        self.model = model
        self.pool = pool
        self.ledger = ledger
        # (model fit, decodes riding along, their KV tokens) → seconds per queued prompt token
        self._queue_rate: tuple[tuple[int, int, int], float] = ((-1, 0, 0), math.inf)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A step ran. Algorithm 1 learns through the latency model; other policies (the
        LLMStation baseline's latency cache) override this."""

    def yield_budget_s(self, view: SchedulingView, *, ahead: Lookahead = NO_LOOKAHEAD) -> float:
        """Seconds the host could pause before running ``view.proposed`` and still meet every
        request's SLO: Δ (only ``tpot_slack_spend_fraction`` of the TPOT slack, as admission
        counts it: :meth:`spendable_delta_s`) less the step's margin-inflated prediction. Only
        ``full`` mode spends slack on training; ``temp`` trains in idle time alone.
        ``ahead``: see :meth:`budget`."""
        if self.config.mode is not AdmissionMode.FULL or not self.model.is_calibrated:
            return 0.0
        if not view.proposed.has_inference:
            return 0.0
        return (self.spendable_delta_s(self.budget(view, ahead=ahead), view.proposed)
                - self.model.predict_upper(view.proposed))

    def spendable_delta_s(self, budget: StepBudget, proposed: StepShape) -> float:
        """What the step may cost with training in it: Δ, except that only
        ``tpot_slack_spend_fraction`` of the TPOT slack beyond the margin-inflated prediction
        of ``proposed`` alone (the step without training) may be spent; none of a slack the
        step alone already overruns."""
        f = self.config.tpot_slack_spend_fraction
        tpot_s = budget.tpot_slack_s
        if f < 1.0 and math.isfinite(tpot_s) and proposed.has_inference:
            tpot_s -= (1.0 - f) * max(0.0, tpot_s - self.model.predict_upper(proposed))
        return min(budget.ttft_slack_s, tpot_s)

    def queue_step_tokens(self, proposed: StepShape) -> int:
        """Queued prompt tokens one full step takes: on a mixed-batching host the requests
        decoding now ride in each such step and take their share of its tokens."""
        mixed = self.limits.batching is not Batching.PHASE_SEPARATED
        d = proposed.num_decode if mixed else 0
        return max(1, self.limits.max_tokens_per_step - d)

    def queue_s_per_token(self, proposed: StepShape) -> float:
        """Predicted seconds per queued prompt token: a full step's margin-inflated prediction
        over the prompt tokens it takes. On a mixed-batching host the requests decoding now
        ride in each such step, taking their share of its tokens and its time (pricing the
        queue at prompt-only steps let a burst's first tokens run late by whole steps)."""
        mixed = self.limits.batching is not Batching.PHASE_SEPARATED
        d = proposed.num_decode if mixed else 0
        key = (self.model.version, d, proposed.kv_tokens if d else 0)
        cached, rate = self._queue_rate
        if cached != key:
            n = self.queue_step_tokens(proposed)
            rate = self.model.predict_upper(StepShape((n,), num_decode=d, kv_tokens=key[2])) / n
            self._queue_rate = (key, rate)
        return rate

    def budget(self, view: SchedulingView, *, ahead: Lookahead = NO_LOOKAHEAD) -> StepBudget:
        """The step's TTFT and TPOT slack. ``ahead.late_s_per_step``: a waiting request's TTFT
        slack keeps it back for every further step it waits through before its first token
        (:func:`~deltaserve.core.slo.ttft_slack_s`), and on a phase-separated host the TPOT
        slack keeps it back for every step the deferred decode waits through (the queued
        prefills and the decode step itself). ``ahead.prompt_tokens_per_s``: on such a host,
        prompts arriving at that rate while the deferred decode waits run before it too, each
        priced as the queue is; the TPOT slack keeps their share of the time back."""
        late_s_per_step = ahead.late_s_per_step
        rate = self.queue_s_per_token(view.proposed)
        deferred, arriving = 0.0, 0.0
        if view.deferred_decode is not None and self.limits.batching is Batching.PHASE_SEPARATED:
            # a phase-separated host runs every prompt it can start before its next decode
            # step (prefill first): the decodes wait for the whole queue behind this step too,
            # and for each of those steps' lateness, as a TTFT does (a TPOT gap on SGLang
            # spanned eight steps under a burst, each late by a little, and ran past the
            # objective though every yield in it was priced: docs/results.md)
            queued = max((w.tokens_after_step for w in view.waiting), default=0)
            further_steps = -(-queued // self.queue_step_tokens(view.proposed)) + 1
            deferred = (self.model.predict_upper(view.deferred_decode) + rate * queued
                        + late_s_per_step * further_steps)
            # under a burst prompts kept arriving through the gap a yield was priced against,
            # and the decodes waited for them too (docs/results.md, SGLang)
            arriving = rate * ahead.prompt_tokens_per_s
        return StepBudget(
            ttft_slack_s(self.slo, view.now_s, view.waiting, rate, late_s_per_step,
                         self.queue_step_tokens(view.proposed)),
            tpot_slack_s(self.slo, view.now_s, view.oldest_decode_token_s, deferred, arriving),
        )

    def _gate(self, view: SchedulingView, backward_running: bool,
              batch_room_tokens: int | None) -> Skip | None:
        """Why nothing may be admitted this step, before any pricing (``None``: something may)."""
        skip = self._precheck(view, backward_running)
        if skip is None and batch_room_tokens is not None and batch_room_tokens <= 0:
            skip = Skip.BUFFER_FULL
        return skip

    def _room(self, proposed: StepShape, batch_room_tokens: int | None
              ) -> tuple[int, int, float]:
        """Training tokens and sequences the step may still take (host and config limits, the
        buffer's largest free run), and the tokens the backward batch still misses."""
        room_tokens = min(self.limits.max_tokens_per_step - proposed.num_tokens,
                          self.config.max_ft_tokens_per_step, self.ledger.largest_free_run)
        room_seqs = self.limits.max_seqs_per_step - proposed.num_seqs
        batch_room = math.inf if batch_room_tokens is None else batch_room_tokens
        return room_tokens, room_seqs, batch_room

    def plan(self, view: SchedulingView, *, backward_running: bool = False,
             batch_room_tokens: int | None = None, reserve_s: float = 0.0,
             ahead: Lookahead = NO_LOOKAHEAD) -> AdmissionPlan:
        """Admit samples into ``view.proposed``.

        ``backward_running``: the backward process is busy with the previous batch.
        ``batch_room_tokens``: tokens still missing from the backward batch being filled. A
        sample may start only while the batch is short (the last one may overshoot), so every
        sample of a batch is forwarded with the adapter the backward will differentiate.
        ``reserve_s``: seconds of Δ the step must leave unspent (after a yield to the backward,
        the reserve the yield kept for the step's lateness: :mod:`deltaserve.core.yield_reserve`).
        ``ahead``: what the steps ahead keep back (:meth:`budget`).
        """
        proposed = view.proposed
        skip = self._gate(view, backward_running, batch_room_tokens)
        if skip is not None:
            return AdmissionPlan((), proposed, None, math.nan, skip)
        budget = self.budget(view, ahead=ahead)
        pricer = self.model.ft_pricer(proposed)
        assert pricer is not None  # _precheck: calibrated
        base_s = pricer.upper_s(0, 0) if proposed.has_inference else 0.0
        delta = self.spendable_delta_s(budget, proposed) - reserve_s
        if base_s > delta:
            return AdmissionPlan((), proposed, budget, base_s, Skip.BUDGET_EXHAUSTED)

        room_tokens, room_seqs, batch_room = self._room(proposed, batch_room_tokens)
        lens, c, stop = self._fill(pricer, base_s, delta, room_tokens, room_seqs, batch_room)
        if not lens:
            return AdmissionPlan((), proposed, budget, base_s, stop)
        return self._admit(proposed, lens, budget, c, stop)

    def _fill(self, pricer: FtPricer, base_s: float, delta: float, room_tokens: int,
              room_seqs: int, batch_room: float) -> tuple[list[int], float, Skip]:
        """The longest prefix of the pool's candidates (shortest first) that fits ``delta`` and
        the rooms; its lengths, its margin-inflated cost and why the next one did not fit."""
        # Equation I is linear in (Σm², Σm) of the samples, and candidates come in runs of equal
        # length: each run's admitted count has a closed form (one check per run, not per
        # sample), after which the next candidate says why admission stopped.
        # once a sample rides along, the inference rows may cost more (ζ of the latency model)
        base = pricer.base_s + pricer.beside_s
        alpha, gamma, scale = pricer.alpha, pricer.gamma, pricer.scale

        def cost(sq: int, tok: int) -> float:
            return (base + alpha * sq + gamma * tok) * scale

        lens: list[int] = []
        sq = tok = 0
        c = base_s
        stop = Skip.POOL_EMPTY
        for n, count in self.pool.iter_buckets():
            k = max(0, min(count, (room_tokens - tok) // n, room_seqs - len(lens)))
            if batch_room != math.inf:  # a sample may start while the batch is short
                k = min(k, max(0, -(-(batch_room - tok) // n)))
            per = alpha * n * n + gamma * n
            if k and per > 0 and math.isfinite(delta):
                cap = k
                q = (delta / scale - base - alpha * sq - gamma * tok) / per
                k = cap if q >= cap else max(0, int(q))
                # the closed form rounds: settle on the exact greedy boundary
                while k > 0 and cost(sq + k * n * n, tok + k * n) > delta:
                    k -= 1
                while k < cap and cost(sq + (k + 1) * n * n, tok + (k + 1) * n) <= delta:
                    k += 1
            if k:
                lens += [n] * k
                sq, tok = sq + k * n * n, tok + k * n
                c = cost(sq, tok)
            if k < count:  # the next candidate (length n) does not fit: why
                if tok >= batch_room:
                    stop = Skip.BUFFER_FULL
                elif tok + n > room_tokens or len(lens) >= room_seqs:
                    # the buffer's free run and the host's step limits both bound the step
                    stop = Skip.BUFFER_FULL if tok + n > self.ledger.largest_free_run \
                        else Skip.STEP_LIMIT
                else:
                    stop = Skip.OVER_BUDGET
                break
        return lens, c, stop

    def _admit(self, proposed: StepShape, lens: list[int], budget: StepBudget | None,
               cost: float, stop: Skip) -> AdmissionPlan:
        """Claim the first ``len(lens)`` candidates of the pool (whose lengths are ``lens``) and
        reserve their rows as one contiguous run."""
        ids = self.pool.claim_first(len(lens))
        row_start = self.ledger.reserve_many(ids, lens)
        assert row_start is not None  # the step's tokens fit the largest free run
        return AdmissionPlan(tuple(ids), proposed.with_ft(tuple(lens)), budget, cost, stop,
                             row_start)

    def _precheck(self, view: SchedulingView, backward_running: bool) -> Skip | None:
        cfg = self.config
        if cfg.mode is AdmissionMode.OFF:
            return Skip.OFF
        if backward_running and not cfg.admit_during_backward:
            return Skip.BACKWARD_RUNNING
        smallest = self.pool.smallest_available()
        if smallest is None:
            return Skip.POOL_EMPTY
        if self.ledger.largest_free_run < smallest:
            return Skip.BUFFER_FULL
        if cfg.mode is AdmissionMode.TEMP and view.proposed.has_inference:
            return Skip.INFERENCE_PRESENT
        if self.limits.batching is Batching.PHASE_SEPARATED and view.proposed.is_decode_only:
            return Skip.DECODE_ONLY_STEP
        if not self.model.is_calibrated:
            return Skip.UNCALIBRATED
        return None
