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

Each probe runs one untimed warm-up step and then ``repeats`` timed steps. The run is a
generator the scheduler advances once per step, so the same code serves an in-process host
(which drives ``llm_engine.step()`` until it is done) and the engine process of
``deltaserve serve`` (whose busy loop steps it before the API server accepts requests).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

from deltaserve.core.calibration import CalibrationConfig, CalibrationProbe, HostLimits, build_plan
from deltaserve.core.latency_model import LatencyModel, LatencyModelConfig
from deltaserve.core.shape import StepShape
from deltaserve.hosts.vllm.hidden import HiddenKind
from deltaserve.hosts.vllm.registry import ForwardRecord, TrainingRows
from deltaserve.hosts.vllm.view import Executed

# Set-up steps a probe may take beyond what its token count needs before it is skipped (a probe
# can stall when vLLM preempts or defers its requests).
_STEP_SLACK = 16


@dataclass(frozen=True)
class StepResult:
    shape: StepShape
    seconds: float
    forward: ForwardRecord | None


class CalibrationRun:
    """One pass over the calibration plan, advanced by the scheduler step by step."""

    def __init__(self, limits: HostLimits, config: CalibrationConfig | None,
                 latency: LatencyModelConfig | None, *, vocab_size: int, num_layers: int,
                 hidden_size: int, dtype: torch.dtype, train_lora: Any, block_size: int,
                 prefix_caching: bool, seed: int = 0,
                 on_probe: Callable[[int, int], None] | None = None,
                 on_done: Callable[[CalibrationRun], None] | None = None):
        self.plan: tuple[CalibrationProbe, ...] = build_plan(limits, config)
        self.model = LatencyModel(latency)
        self.limits = limits
        self.vocab_size = vocab_size
        self.train_lora = train_lora
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.on_probe = on_probe
        self.on_done = on_done
        self.rng = random.Random(seed)
        ft_max = max((p.shape.num_ft_tokens for p in self.plan), default=0)
        self.scratch = torch.empty(num_layers, max(ft_max, 1), hidden_size, dtype=dtype)
        self.done = False
        self.points = 0
        self.skipped: list[str] = []
        self._sched: Any = None
        self._gen: Generator[None, StepResult, None] | None = None
        self._ft: list[tuple[str, int]] = []

    # ---- what the scheduler calls -----------------------------------------------------------
    def before_schedule(self, sched: Any) -> None:
        if self._gen is None:
            self._sched = sched
            self._gen = self._run()
            self._advance(None)

    def rows_for(self, ex: Executed) -> TrainingRows | None:
        """The probe's training rows in this step (those vLLM scheduled whole)."""
        ft = [(rid, n) for rid, n in self._ft if ex.hidden.get(rid) == (0, n)]
        if not ft:
            return None
        return TrainingRows(tuple(r for r, _ in ft), tuple(n for _, n in ft), self._capture)

    def after_step(self, sched: Any, shape: StepShape, seconds: float,
                   forward: ForwardRecord | None) -> None:
        self._advance(StepResult(shape, seconds, forward))

    # ---- the run ----------------------------------------------------------------------------
    def _capture(self, layer: int, rows: torch.Tensor) -> None:
        self.scratch[layer, : rows.shape[0]].copy_(rows)

    def _advance(self, value: StepResult | None) -> None:
        assert self._gen is not None
        try:
            self._gen.send(value)  # type: ignore[arg-type]
        except StopIteration:
            self.done = True
            self.model.fit()
            if self.on_done is not None:
                self.on_done(self)

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab_size) for _ in range(n)]

    def _run(self) -> Generator[None, StepResult, None]:
        for i, probe in enumerate(self.plan):
            yield from self._probe(probe)
            if self.on_probe is not None:
                self.on_probe(i + 1, len(self.plan))

    def _probe(self, probe: CalibrationProbe) -> Generator[None, StepResult, None]:
        sched, hidden = self._sched, self._sched.hidden
        shape = probe.shape
        steps = probe.repeats + 1
        budget = self.limits.max_tokens_per_step
        if not self._fits_kv(probe, steps):
            self.skipped.append(f"{probe.kind}: {shape} (KV cache too small)")
            return
        if probe.prefix_len and not self.prefix_caching:
            self.skipped.append(f"{probe.kind}: {shape} (needs prefix caching)")
            return
        owned: list[str] = []
        stall = _STEP_SLACK + math.ceil(
            (shape.num_decode * probe.kv_per_decode + probe.prefix_len) / budget)
        try:
            decodes = []
            if shape.num_decode:
                prompt = max(1, probe.kv_per_decode - 1)  # + 1 sampled token = kv_per_decode
                room = self.limits.max_model_len - prompt
                for _ in range(shape.num_decode):
                    req = hidden.add(HiddenKind.PROBE, self._tokens(prompt), max_tokens=room,
                                     ignore_eos=True)
                    decodes.append(req)
                    owned.append(req.request_id)
            salt, prefix = None, []
            if probe.prefix_len:
                salt = f"deltaserve-calibration-{self.rng.getrandbits(64):x}"
                prefix = self._tokens(probe.prefix_len)
                owned.append(hidden.add(HiddenKind.PROBE, prefix, salt=salt).request_id)
            # set-up: every decode past its prompt, the shared prefix computed and cached
            while not all(r.num_computed_tokens >= r.num_prompt_tokens for r in decodes) \
                    or (prefix and owned[-1] in sched.requests):
                yield
                stall -= 1
                if stall < 0 or any(r.request_id not in sched.requests for r in decodes):
                    self.skipped.append(f"{probe.kind}: {shape} (set-up did not finish)")
                    return
            for step in range(steps):
                extra = [hidden.add(HiddenKind.PROBE, prefix + self._tokens(n), salt=salt)
                         for n in shape.prefill_lens]
                owned += [r.request_id for r in extra]
                self._ft = [(hidden.add(HiddenKind.PROBE_FT, self._tokens(m),
                                        lora_request=self.train_lora).request_id, m)
                            for m in shape.ft_lens]
                owned += [r for r, _ in self._ft]
                result = yield
                self._ft = []
                if step > 0 and not result.shape.is_empty:
                    self.model.add_calibration(result.shape, result.seconds)
                    self.points += 1
                hidden.abort([r.request_id for r in extra])  # a chunk left over, if any
        finally:
            self._ft = []
            hidden.abort(owned)

    def _fits_kv(self, probe: CalibrationProbe, steps: int) -> bool:
        """Whether the probe's requests fit the KV cache's free blocks (else vLLM preempts)."""
        pool = self._sched.kv_cache_manager.block_pool
        blocks = 0
        growth = steps + _STEP_SLACK
        s = probe.shape
        blocks += s.num_decode * math.ceil((probe.kv_per_decode + growth) / self.block_size)
        per_step = sum(probe.prefix_len + n for n in s.prefill_lens) + s.num_ft_tokens
        blocks += math.ceil((per_step + probe.prefix_len) / self.block_size) + len(s.prefill_lens) \
            + len(s.ft_lens)
        return blocks <= pool.get_num_free_blocks()


def calibrate(host: Any, lora: Any, config: CalibrationConfig | None = None,
              latency: LatencyModelConfig | None = None, *, seed: int = 0,
              progress: bool = True) -> LatencyModel:
    """Run the calibration plan through vLLM on an idle :class:`VLLMHost` and fit a latency
    model. Training rows use the reserved training adapter; if none is reserved yet, PEFT's
    initial weights for ``lora`` (a :class:`LoRAConfig`) are loaded into it."""
    from tqdm import tqdm

    from deltaserve.hosts.vllm.coserve import new_calibration

    if host.has_unfinished():
        raise RuntimeError("calibrate an idle engine: requests are in flight")
    link = host.link
    if link.train_lora is None:
        host.reserve_training_adapter(lora, seed)
    bar = tqdm(desc="calibrating vLLM", unit="probe", disable=not progress)

    def on_probe(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    run = new_calibration(link, host, config, latency, seed, on_probe)
    link.calibration = run
    try:
        while not run.done:
            host.step()
    finally:
        link.calibration = None
        bar.close()
    return run.model
