"""The simulated GPU host: the embedded engine's real scheduler on a simulated clock.

Real: the engine's scheduler and KV-block manager (continuous batching, chunked prefill,
preemption; blocks sized for the GPU's memory), the client half (:class:`~deltaserve.hosts.base.
BaseHost`) and, once attached, the whole co-server policy (admission, sample book, latency model
with its calibration plan and online refit, the grant calls, interruption). Timed stand-ins: the
model runner (a step takes the oracle's time with noise, stretched where the backward overlaps
it; its sampled token is 0) and the backward (:mod:`deltaserve.hosts.sim.trainer`).

The engine drives itself through its clock's events: a step begins (``co.plan``, then its end is
scheduled), ends (``co.observe``, tokens emitted at the end's time) and the next begins at once;
an idle engine sleeps until an arrival or its backward's completion. An arrival during an
abortable (training-only) step schedules a check at the next layer boundary, where the step asks
``should_abort`` like a real forward does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from deltaserve.core.calibration import Batching, CalibrationConfig, HostLimits
from deltaserve.core.contract import CoServingHooks, StepReport, TrainingStep
from deltaserve.core.data import TrainingSample
from deltaserve.core.errors import InputError, require
from deltaserve.core.latency_model import LatencyModel, LatencyModelConfig
from deltaserve.core.requests import SamplingParams, TokenCallback
from deltaserve.core.shape import ExecMode, StepShape
from deltaserve.hosts.base import BaseHost, ClientRequest
from deltaserve.hosts.native.block_manager import BlockManager
from deltaserve.hosts.native.request import Request
from deltaserve.hosts.native.scheduler import ScheduledBatch, Scheduler
from deltaserve.hosts.native.stopping import finish_reason
from deltaserve.hosts.native.view import scheduling_view, step_shape
from deltaserve.hosts.sim.calibrate import calibrate, graph_mode
from deltaserve.hosts.sim.clock import SimClock
from deltaserve.hosts.sim.config import SimHostConfig
from deltaserve.hosts.sim.device import GpuTimeline
from deltaserve.hosts.sim.hardware import SimHardware, gpu_hardware
from deltaserve.hosts.sim.oracle import StepNoise
from deltaserve.hosts.sim.steps import RunningStep, YieldingStep, sim_batch
from deltaserve.hosts.sim.trainer import SimTrainerFactory
from deltaserve.model.config import ModelConfig
from deltaserve.model.llama import BaseWeights
from deltaserve.model.lora import AdapterWeights, LoRAConfig
from deltaserve.train.config import CoServeConfig, GrantPolicy
from deltaserve.train.facade import CoServer

SAMPLED_TOKEN = 0  # what a simulated step "samples": no logits exist


class SimTraining:
    """A simulated host's :class:`~deltaserve.train.attach.TrainingHalf`: the timed stand-in
    (:mod:`deltaserve.hosts.sim.trainer`) on the engine's clock and simulated device, under the
    same attach as every real host (:meth:`BaseHost.attach`)."""

    def __init__(self, engine: SimEngine):
        self.engine = engine

    def trainer_factory(self, config: CoServeConfig, validation: Sequence[TrainingSample]
                        ) -> SimTrainerFactory:
        require(not validation, "validation", f"{len(validation)} samples",
                "a simulated host computes no loss")
        e = self.engine
        policy = config.backward.grant_policy
        if policy is not GrantPolicy.AUTO and policy is not e.device.policy:
            # the device shares itself as this co-server's backward asks (nothing runs yet)
            e.device = GpuTimeline(e.clock, policy, e.hw.params)
        return SimTrainerFactory(e.clock, e.device, e.hw.backward,
                                 StepNoise(e.hw.noise_sigma, e.noise_seed + 1), e.hw.tp)

    def install(self, co: CoServer) -> None:
        """Nothing to install: simulated steps read no weights."""


class SimEngine(BaseHost):
    config_cls = SimHostConfig

    def __init__(self, config: SimHostConfig | None = None, *, clock: SimClock | None = None,
                 hardware: SimHardware | None = None, seed: int | None = None):
        self.config = config = config or SimHostConfig()
        self.clock = clock or SimClock()
        self.hw = hardware or gpu_hardware(config, LoRAConfig())
        super().__init__(None, config.model_len(self.hw.shape.max_context), clock=self.clock)
        self._kv_tokens = min(config.kv_cache_tokens, self.hw.kv_tokens)
        self.blocks = BlockManager(self._kv_tokens // config.block_size, config.block_size)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        self.noise_seed = config.seed if seed is None else seed
        self.noise = StepNoise(self.hw.noise_sigma, self.noise_seed)
        self.device = GpuTimeline(self.clock, self.hw.policy, self.hw.params)
        self._requests: dict[str, Request] = {}
        self._running: RunningStep | None = None
        self._yielding: YieldingStep | None = None
        self._backward_version = -1
        self.on_backward_local_done: Callable[[], None] = self.finish_backward_alone
        # the engine settled after an event (a data-parallel group re-checks its round)
        self.after_kick: Callable[[], None] = lambda: None
        # a request finished (its output waits in pop_finished unless it had a callback)
        self.on_finished: Callable[[str], None] = lambda request_id: None

    # ---- the co-server's side (TrainingHost) ------------------------------------------------
    @property
    def limits(self) -> HostLimits:
        c = self.config
        return HostLimits(c.max_num_batched_tokens, c.max_num_seqs, self.max_model_len,
                          self._kv_tokens, Batching.MIXED)

    @property
    def model_path(self) -> str:
        return self.hw.name

    @property
    def model_config(self) -> ModelConfig:
        s = self.hw.shape
        return ModelConfig(s.vocab, s.hidden, s.ffn, s.num_layers, s.num_q_heads,
                           s.num_kv_heads, s.head_dim, max_position_embeddings=s.max_context)

    def backward_weights(self) -> BaseWeights:
        raise InputError("host", "sim", "a simulated host has no weights: its co-server trains a "
                         "timed stand-in (SimTraining)")

    def check_coserve_config(self, config: CoServeConfig) -> None:
        """The simulated host's replicas are a fleet (:mod:`deltaserve.hosts.sim.fleet`), which
        prices their all-reduce itself: a real group's config has no meaning here."""
        require(not config.data_parallel.distributed, "data_parallel", config.data_parallel,
                "a simulated host trains no real group: simulate replicas with a fleet")

    def training_dropout(self, lora: LoRAConfig) -> float:
        return lora.dropout

    def install_training_adapter(self, adapter: AdapterWeights) -> None:
        """Nothing to install: simulated steps read no weights."""

    def publish_adapter(self, adapter: AdapterWeights) -> None:
        """Nothing to publish: simulated steps read no weights."""

    def calibrate(self, lora: LoRAConfig, calibration: CalibrationConfig | None,
                  latency: LatencyModelConfig | None, *, seed: int = 0,
                  progress: bool = True) -> LatencyModel:
        return calibrate(self.hw, self.limits, calibration, latency, seed=seed)

    def training_half(self) -> SimTraining:
        return SimTraining(self)

    def detach(self, *, drain: bool = True, checkpoint: bool = True) -> CoServer | None:
        """Stop co-serving. A step in flight that carries samples finishes first (simulated
        time runs on until it is observed), then the co-server trains (``drain``) or returns
        what it captured."""
        co, self._co = self._co, None
        if co is None:
            return None
        self.set_coserver(None)
        if self._carries_samples():
            self.clock.run(until=lambda: not self._carries_samples())
        co.close(drain=drain, checkpoint=checkpoint)
        return co

    def _carries_samples(self) -> bool:
        run = self._running
        return run is not None and run.step is not None and bool(run.step.rows.num_samples)

    # ---- clients ----------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    adapter: str | None = None, callback: TokenCallback | None = None,
                    request_id: str | None = None) -> str:
        """As on any host, at the current simulated time; an idle engine starts at once and a
        running abortable step is checked at its next layer boundary."""
        rid = super().add_request(prompt, params, adapter=adapter, callback=callback,
                                  request_id=request_id)
        run, y = self._running, self._yielding
        if y is not None:
            self._resume(y)  # an arrival ends a yield at once (the host's wake event)
        elif run is None:
            self.kick()
        elif run.step is not None and run.step.abortable:
            now = self.clock.now()
            k = max(1, math.ceil((now - run.start_s) / run.layer_s - 1e-9))
            if k < run.num_layers:
                self.clock.at(run.start_s + k * run.layer_s, lambda: self._layer_check(run, k))
        return rid

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """A simulated prompt is its length: token ids are never read, so they are not
        converted one by one (only text, which needs a tokenizer, is refused)."""
        if isinstance(prompt, str):
            return super()._prompt_ids(prompt)
        if not prompt:
            raise InputError("prompt", prompt, "is empty")
        if len(prompt) >= self.max_model_len:
            raise InputError("prompt", f"{len(prompt)} tokens",
                             f"must be shorter than max_model_len={self.max_model_len}")
        return list(prompt)

    # ---- the engine half --------------------------------------------------------------------
    def _engine_submit(self, req: ClientRequest) -> None:
        r = Request(req.request_id, list(req.prompt), req.params, req.adapter, req.arrival_s)
        self._requests[r.request_id] = r
        self.scheduler.add(r)

    def _engine_abort(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req)

    def _load_lora(self, name: str, path: str) -> None:
        raise InputError("adapter", name, "the simulated host serves the base model only")

    def _unload_lora(self, name: str) -> None:
        """No client adapter can be loaded."""

    def kick(self) -> None:
        """Start the next step if the engine is free; else, with co-serving work pending, lend
        the device to the backward and sleep until it or an arrival wakes the engine."""
        for _ in range(3):  # a backward result handled while idle may make a step possible
            if self._running is not None or self._yielding is not None or self.step():
                break
            co = self.coserver
            if co is None or not co.wants_step():
                break
            job = self.device.job
            co.idle(0.0)
            if self.device.job is job:
                break  # nothing completed: the backward's completion or an arrival wakes it
        self._watch_backward()
        self.after_kick()

    def _engine_step(self) -> bool:
        batch = self.scheduler.schedule()
        mode = self._mode(batch)
        co = self.coserver
        if co is None:
            if batch.is_empty:
                return False
            self._begin(batch, None, step_shape(batch, mode))
            return True
        if not batch.is_empty:
            now = self.clock.now()
            pause = co.yield_budget_s(scheduling_view(batch, self.scheduler, now, mode))
            if pause > 0:  # the SLOs have room: the backward gets the device first
                co.yield_to_backward(pause, self._wake)
                y = self._yielding = YieldingStep(batch, mode)
                self.clock.at(now + pause, lambda: self._resume(y))
                return True
        return self._plan_and_begin(co, batch, mode)

    def _resume(self, y: YieldingStep) -> None:
        """The lent time is over (or an arrival cut it short): plan and run the step."""
        if self._yielding is not y:
            return
        self._yielding = None
        co = self.coserver
        if co is None:
            self._begin(y.batch, None, step_shape(y.batch, y.mode))
        else:
            self._plan_and_begin(co, y.batch, y.mode)
        self._watch_backward()

    def _plan_and_begin(self, co: CoServingHooks, batch: ScheduledBatch, mode: ExecMode
                        ) -> bool:
        view = scheduling_view(batch, self.scheduler, self.clock.now(), mode)
        step = co.plan(view)
        if batch.is_empty and not step.rows.num_samples:
            co.observe(StepReport(step, step.plan.shape, 0.0))  # nothing ran
            return False
        self._begin(batch, step, step.plan.shape if step.rows.num_samples else view.proposed)
        return True

    def _mode(self, batch: ScheduledBatch) -> ExecMode:
        if not self.hw.graphs or batch.is_empty or batch.prefills:
            return ExecMode.EAGER
        return graph_mode(self.hw, StepShape(num_decode=len(batch.items)))

    def _begin(self, batch: ScheduledBatch, step: TrainingStep | None, shape: StepShape
               ) -> None:
        ft = step.rows.lengths if step is not None else ()
        base_s = self.hw.oracle.step_seconds(sim_batch(batch, ft, shape.mode, self.hw.tp))
        seconds = self.device.begin_step(base_s * self.noise.factor())
        run = RunningStep(batch, self.coserver, step, shape, self.clock.now(), seconds,
                       self.hw.shape.num_layers)
        self._running = run
        self.clock.at(run.start_s + seconds, lambda: self._end(run, None))

    def _layer_check(self, run: RunningStep, layer: int) -> None:
        """The forward reached ``layer``'s boundary: a real one asks ``should_abort`` here."""
        if self._running is run and run.step is not None and run.step.should_abort():
            self._end(run, layer)

    def _end(self, run: RunningStep, aborted_at: int | None) -> None:
        if self._running is not run:
            return  # aborted earlier at a layer boundary
        self._running = None
        self.device.end_step()
        aborted = aborted_at is not None
        seconds = run.layer_s * aborted_at if aborted_at is not None else run.seconds
        co, step = run.co, run.step
        if co is not None and step is not None:
            co.observe(StepReport(step, run.shape, seconds, aborted,
                                  aborted_at if aborted else run.num_layers))
        self._record(run.shape, seconds, step.rows.num_tokens if step is not None else 0,
                     aborted)
        if not aborted:
            self._postprocess(run.batch)
        self.kick()

    def _postprocess(self, batch: ScheduledBatch) -> None:
        now = self.clock.now()
        for item in batch.items:
            req = item.request
            completes = item.completes_prompt
            req.num_computed += item.num_tokens
            if not completes:
                continue
            req.output_token_ids.append(SAMPLED_TOKEN)
            req.token_times_s.append(now)
            reason, text = finish_reason(req, SAMPLED_TOKEN, frozenset(), self.max_model_len,
                                         None)
            if reason is not None:
                self.scheduler.finish(req)
                del self._requests[req.request_id]
            self._emit(req.request_id, [SAMPLED_TOKEN], reason, text)
            if reason is not None:
                self.on_finished(req.request_id)

    @property
    def holds_samples(self) -> bool:
        """Training samples are in a running step, captured, or in the backward."""
        if self._carries_samples():
            return True
        co = self._co
        return co is not None and co.trainer.has_pending

    # ---- the backward's own events ----------------------------------------------------------
    def _watch_backward(self) -> None:
        """Schedule the backward's next change of state (its local work completing) whenever
        the rates it progresses at have changed."""
        d = self.device
        if d.version == self._backward_version:
            return
        self._backward_version = version = d.version
        t = d.local_done_at()
        if math.isfinite(t):
            self.clock.at(max(t, self.clock.now()), lambda: self._local_done(version))

    def _local_done(self, version: int) -> None:
        if self.device.version != version:
            return  # superseded: the rate changed since
        self.device.finish_local()
        self.on_backward_local_done()

    def finish_backward_alone(self) -> None:
        """No data-parallel group: the optimizer step follows the local work at once."""
        job = self.device.job
        assert job is not None
        self.complete_backward_at(self.clock.now() + job.timing.optimizer_s)

    def complete_backward_at(self, t_s: float) -> None:
        """The job (all-reduce and optimizer step included) completes at ``t_s``."""
        self.device.reduce_until(t_s)
        self.clock.at(t_s, self.kick)
