"""Start-up calibration through vLLM's real scheduling and forward path.

Every probe of the plan (:func:`deltaserve.core.build_plan`) is realised with hidden requests
that vLLM schedules like any other, and every timed point is the shape vLLM actually executed
(read from its ``SchedulerOutput``) with the forward time the worker measured:

* decodes: ``num_decode`` requests whose prompts (distinct random tokens, so every request holds
  its own KV blocks) are prefilled during set-up steps; the probe's steps then decode all of them;
* prefills: fresh requests of the probe's lengths; a chunk behind a cached context reuses a
  prefix computed in a set-up step (same cache salt), so the chunk runs behind real KV blocks;
* training rows: requests on the reserved training adapter, captured into a scratch buffer of
  the co-server's layout, so the capture copy is part of the timing.

Each probe runs one untimed warm-up step and then ``repeats`` timed steps; every timed step is
its own point (vLLM may run a probe's steps in different shapes). vLLM steps when its engine loop
does, not when the calibration asks, so the prober is a
:class:`~deltaserve.core.calibration_loop.SteppedProber` and :class:`CalibrationRun` advances the
shared loop (:func:`~deltaserve.core.calibration_loop.calibration_steps`) once per scheduler step.
The same code serves an in-process host (which drives ``llm_engine.step()`` until it is done) and
the engine process of ``deltaserve serve`` (whose busy loop steps it before the API server accepts
requests). The training rows of a probe are a :class:`~deltaserve.hosts.probe.ProbeStep` handed to
the worker's hooks like a co-server's step.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch
from vllm.lora.request import LoRARequest
from vllm.v1.core.sched.scheduler import Scheduler

from deltaserve.core.calibration import CalibrationConfig, CalibrationProbe, HostLimits
from deltaserve.core.calibration_loop import ProbeTiming, calibration_steps
from deltaserve.core.latency_model import LatencyModel, LatencyModelConfig
from deltaserve.core.shape import StepShape
from deltaserve.hosts.probe import probe_step, random_rows
from deltaserve.hosts.vllm.hidden import HiddenKind, HiddenRequests, new_salt
from deltaserve.hosts.vllm.link import RowLayout
from deltaserve.hosts.vllm.view import Executed
from deltaserve.model.config import ModelConfig

# Set-up steps a probe may take beyond what its token count needs before it is skipped (a probe
# can stall when vLLM preempts or defers its requests).
_STEP_SLACK = 16


@dataclass(frozen=True)
class EngineFacts:
    """What a calibration run needs to know about the engine it runs on."""

    limits: HostLimits
    model_config: ModelConfig
    dtype: torch.dtype
    block_size: int
    prefix_caching: bool


@dataclass(frozen=True)
class StepResult:
    shape: StepShape
    seconds: float


class CalibrationRun:
    """One pass of the shared calibration loop over vLLM, advanced by the scheduler step by
    step. The training adapter must be reserved; ``sample_lora`` is what the probes' training
    rows name (:attr:`EngineLink.sample_lora`: None where the worker's hooks add the adapter)
    and ``dropout`` their LoRA dropout, as the co-server's rows will have them (the masks cost
    time); ``on_done`` is called with the fitted model, which ``model`` then holds."""

    def __init__(self, facts: EngineFacts, config: CalibrationConfig | None,
                 latency: LatencyModelConfig | None, sample_lora: LoRARequest | None,
                 dropout: float, *, seed: int = 0, progress: bool = False,
                 on_done: Callable[[LatencyModel], None] | None = None):
        self.prober = VLLMProber(facts, sample_lora, dropout, seed=seed)
        self.config, self.latency, self.progress = config, latency, progress
        self.on_done = on_done
        self.model: LatencyModel | None = None
        self.done = False
        self._steps: Generator[None, StepResult, LatencyModel] | None = None

    @property
    def points(self) -> int:
        """Timed points so far."""
        return self.prober.points

    # ---- what the scheduler calls -----------------------------------------------------------
    def before_schedule(self, sched: Scheduler, hidden: HiddenRequests) -> None:
        if self._steps is None:
            self.prober.bind(sched, hidden)
            self._steps = calibration_steps(self.prober, self.config, self.latency,
                                            progress=self.progress)
            self._advance(None)

    def rows_for(self, ex: Executed) -> RowLayout | None:
        return self.prober.rows_for(ex)

    def after_step(self, shape: StepShape, seconds: float) -> None:
        self._advance(StepResult(shape, seconds))

    def _advance(self, result: StepResult | None) -> None:
        assert self._steps is not None
        try:
            if result is None:
                next(self._steps)
            else:
                self._steps.send(result)
        except StopIteration as stop:
            self.done = True
            self.model = stop.value
            if self.on_done is not None:
                self.on_done(stop.value)


class VLLMProber:
    """Times each probe over the scheduler steps vLLM runs for it (a
    :class:`~deltaserve.core.calibration_loop.SteppedProber` sent each step's
    :class:`StepResult`). ``bind`` gives it the scheduler before the loop opens it."""

    def __init__(self, facts: EngineFacts, sample_lora: LoRARequest | None, dropout: float, *,
                 seed: int = 0):
        self.facts = facts
        self.sample_lora = sample_lora
        self.dropout = dropout
        self.rng = random.Random(seed)
        self.points = 0
        self.skipped: list[str] = []
        self.scratch: torch.Tensor | None = None
        self._sched: Scheduler | None = None
        self._hidden: HiddenRequests | None = None
        self._ft: list[tuple[str, tuple[int, ...]]] = []

    @property
    def limits(self) -> HostLimits:
        return self.facts.limits

    def bind(self, sched: Scheduler, hidden: HiddenRequests) -> None:
        self._sched, self._hidden = sched, hidden

    def open(self, plan: Sequence[CalibrationProbe]) -> None:
        """A capture buffer for the largest training rows of the plan."""
        ft_max = max((p.shape.num_ft_tokens for p in plan), default=0)
        mc = self.facts.model_config
        self.scratch = torch.empty(mc.num_layers, max(ft_max, 1), mc.hidden_size,
                                   dtype=self.facts.dtype)

    def close(self) -> None:
        self._ft = []

    def rows_for(self, ex: Executed) -> RowLayout | None:
        """The probe's training rows in this step (those vLLM scheduled whole)."""
        ft = [(rid, ids) for rid, ids in self._ft if ex.hidden.get(rid) == (0, len(ids))]
        if not ft:
            return None
        assert self.scratch is not None
        step = probe_step(tuple(ids for _, ids in ft), ex.shape, self.dropout, self.scratch)
        return RowLayout(step, tuple(rid for rid, _ in ft))

    def _tokens(self, n: int) -> list[int]:
        return list(random_rows((n,), self.facts.model_config.vocab_size, self.rng)[0])

    def _skip(self, probe: CalibrationProbe) -> str | None:
        if not self._fits_kv(probe, probe.repeats + 1):
            return "KV cache too small"
        if probe.prefix_len and not self.facts.prefix_caching:
            return "needs prefix caching"
        return None

    def time(self, probe: CalibrationProbe
             ) -> Generator[None, StepResult, Sequence[ProbeTiming]]:
        """One timing per timed step that ran something (none if the probe was skipped)."""
        why = self._skip(probe)
        if why is not None:
            self.skipped.append(f"{probe.kind}: {probe.shape} ({why})")
            return ()
        owned: list[str] = []
        timings: list[ProbeTiming] = []
        try:
            prefix, salt = yield from self._set_up(probe, owned)
            if prefix is None:
                self.skipped.append(f"{probe.kind}: {probe.shape} (set-up did not finish)")
                return ()
            for step in range(probe.repeats + 1):
                result = yield from self._run_step(probe, prefix, salt, owned)
                if step > 0 and not result.shape.is_empty:  # the first run warms caches
                    timings.append(ProbeTiming(result.shape, (result.seconds,)))
                    self.points += 1
            return timings
        finally:
            self._ft = []
            assert self._hidden is not None
            self._hidden.abort(owned)

    def _set_up(self, probe: CalibrationProbe, owned: list[str]
                ) -> Generator[None, StepResult, tuple[list[int] | None, str | None]]:
        """Decode streams past their prompts and the shared prefix computed and cached; returns
        the prefix and its cache salt (prefix None: set-up stalled)."""
        sched, hidden = self._sched, self._hidden
        assert sched is not None and hidden is not None
        shape, limits = probe.shape, self.facts.limits
        decodes = []
        if shape.num_decode:
            prompt = max(1, probe.kv_per_decode - 1)  # + 1 sampled token = kv_per_decode
            for _ in range(shape.num_decode):
                req = hidden.add(HiddenKind.PROBE, self._tokens(prompt),
                                 max_tokens=limits.max_model_len - prompt, ignore_eos=True)
                decodes.append(req)
                owned.append(req.request_id)
        salt, prefix = None, []
        if probe.prefix_len:
            salt = new_salt()  # the probe's own: its chunks share this prefix, no one else
            prefix = self._tokens(probe.prefix_len)
            owned.append(hidden.add(HiddenKind.PROBE, prefix, salt=salt).request_id)
        stall = _STEP_SLACK + math.ceil(
            (shape.num_decode * probe.kv_per_decode + probe.prefix_len)
            / limits.max_tokens_per_step)
        while not all(r.num_computed_tokens >= r.num_prompt_tokens for r in decodes) \
                or (prefix and owned[-1] in sched.requests):
            yield
            stall -= 1
            if stall < 0 or any(r.request_id not in sched.requests for r in decodes):
                return None, None
        return prefix, salt

    def _run_step(self, probe: CalibrationProbe, prefix: list[int], salt: str | None,
                  owned: list[str]) -> Generator[None, StepResult, StepResult]:
        """One step of the probe's prefills and training rows; what vLLM ran and its time."""
        hidden = self._hidden
        assert hidden is not None
        extra = [hidden.add(HiddenKind.PROBE, prefix + self._tokens(n), salt=salt)
                 for n in probe.shape.prefill_lens]
        owned += [r.request_id for r in extra]
        self._ft = []
        for m in probe.shape.ft_lens:
            ids = tuple(self._tokens(m))
            req = hidden.add(HiddenKind.PROBE_FT, ids, lora_request=self.sample_lora)
            self._ft.append((req.request_id, ids))
            owned.append(req.request_id)
        result = yield
        self._ft = []
        hidden.abort([r.request_id for r in extra])  # a chunk left over, if any
        return result

    def _fits_kv(self, probe: CalibrationProbe, steps: int) -> bool:
        """Whether the probe's requests fit the KV cache's free blocks (else vLLM preempts)."""
        assert self._sched is not None
        pool = self._sched.kv_cache_manager.block_pool
        block = self.facts.block_size
        growth = steps + _STEP_SLACK
        s = probe.shape
        blocks = s.num_decode * math.ceil((probe.kv_per_decode + growth) / block)
        per_step = sum(probe.prefix_len + n for n in s.prefill_lens) + s.num_ft_tokens
        blocks += math.ceil((per_step + probe.prefix_len) / block) + len(s.prefill_lens) \
            + len(s.ft_lens)
        return blocks <= pool.get_num_free_blocks()
