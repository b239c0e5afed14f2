"""N data-parallel replicas of the simulated host behind a router, replaying a trace on one
simulated clock.

Each replica is a :class:`~deltaserve.hosts.sim.engine.SimEngine` with its own scheduler, KV
cache, latency model (refit online from its own steps), co-server and backward. Co-serving
replicas claim from one shared sample pool and train one adapter synchronously
(:mod:`deltaserve.hosts.sim.dp`). Requests are routed when they arrive: ``round-robin``, or
``least-loaded`` (fewest unfinished requests; ties rotate). A replay ends when every request
has finished (or ``drain_timeout_s`` after the last arrival), and not before ``min_end_s``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from deltaserve.core.admission import AdmissionScheduler
from deltaserve.core.contract import StepRecord
from deltaserve.core.data import TrainingSample
from deltaserve.core.errors import require
from deltaserve.core.latency_model import LatencyModel, OnlineError
from deltaserve.core.pool import SamplePool
from deltaserve.core.requests import SamplingParams
from deltaserve.hosts.sim.clock import SimClock
from deltaserve.hosts.sim.config import SimHostConfig
from deltaserve.hosts.sim.dp import GradientSync
from deltaserve.hosts.sim.engine import SimEngine
from deltaserve.hosts.sim.hardware import SimHardware
from deltaserve.train.config import CoServeConfig
from deltaserve.train.events import OptimizerStep, TrainingEvent
from deltaserve.train.facade import CoServer
from deltaserve.workloads.trace import Trace


class Router(StrEnum):
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"


@dataclass
class RequestTimes:
    """One trace request as its client saw it (simulated seconds)."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    replica: int = -1
    token_times_s: tuple[float, ...] = ()
    finished: bool = False


@dataclass(frozen=True)
class CoServing:
    """What co-serving replicas run: their config, the calibrated latency model each starts
    from (a copy each), the admission policy and the data."""

    config: CoServeConfig
    latency_model: LatencyModel
    samples: Sequence[TrainingSample]
    scheduler_cls: type[AdmissionScheduler] = AdmissionScheduler
    allreduce_s: float = 0.0


@dataclass
class FleetRun:
    """A replay's outcome. ``steps``: every replica's executed steps (``replica_steps``: per
    replica); ``commits``: optimizer steps of every replica (one per replica per global step);
    ``online_error``: each replica's latency-model error on the steps it served;
    ``barrier_wait_s``: replica-seconds the data-parallel barrier held backwards back."""

    requests: list[RequestTimes]
    end_s: float
    timed_out: bool
    replica_steps: list[list[StepRecord]]
    commits: list[OptimizerStep] = field(default_factory=list)
    online_error: list[tuple[OnlineError, ...]] = field(default_factory=list)
    barrier_wait_s: float = 0.0
    global_steps: int = 0
    events: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time for the replay (the speed on a shared machine)

    @property
    def steps(self) -> list[StepRecord]:
        return sorted((s for steps in self.replica_steps for s in steps), key=lambda s: s.t_s)


class Fleet:
    def __init__(self, hardware: SimHardware, config: SimHostConfig, replicas: int = 1,
                 router: Router = Router.ROUND_ROBIN, *, seed: int = 0):
        require(replicas >= 1, "replicas", replicas, "must be >= 1")
        self.clock = SimClock()
        self.router = Router(router)
        self.engines = [SimEngine(config, clock=self.clock, hardware=hardware,
                                  seed=seed * 7919 + 101 * rank) for rank in range(replicas)]
        self.coservers: list[CoServer] = []
        self.sync: GradientSync | None = None
        self.commits: list[OptimizerStep] = []
        self._load = [0] * replicas
        self._turn = 0
        self._steps: list[list[StepRecord]] = [[] for _ in range(replicas)]
        self._sent: dict[str, RequestTimes] = {}
        self._left = 0
        for rank, (eng, steps) in enumerate(zip(self.engines, self._steps, strict=True)):
            eng.subscribe_steps(steps.append)
            eng.on_finished = lambda rid, rank=rank: self._finished(rank, rid)

    def coserve(self, setup: CoServing, num_epochs: int | None = None) -> SamplePool:
        """Attach a co-server to every replica over one shared pool; returns the pool."""
        cfg = setup.config
        pool = SamplePool([s.num_tokens for s in setup.samples],
                          num_epochs=cfg.num_epochs if num_epochs is None else num_epochs,
                          seed=cfg.seed)
        self.sync = sync = GradientSync(len(self.engines), setup.allreduce_s)
        for rank, eng in enumerate(self.engines):
            co = eng.attach(dataset=setup.samples, config=cfg,
                            latency_model=copy.deepcopy(setup.latency_model),
                            scheduler_cls=setup.scheduler_cls, pool=pool)
            co.subscribe(self._on_event)
            eng.on_backward_local_done = self._arrive(rank, eng, sync)
            sync.member(rank, lambda eng=eng: (not eng.holds_samples
                                               and pool.smallest_available() is None))
            eng.after_kick = lambda: sync.poll(self.clock.now())
            self.coservers.append(co)
        return pool

    def _arrive(self, rank: int, eng: SimEngine, sync: GradientSync):
        def arrive() -> None:
            job = eng.device.job
            assert job is not None
            sync.arrive(rank, self.clock.now(), job.timing.optimizer_s, eng.complete_backward_at)
        return arrive

    def _on_event(self, event: TrainingEvent) -> None:
        if isinstance(event, OptimizerStep):
            self.commits.append(event)

    # ---- routing ----------------------------------------------------------------------------
    def route(self) -> int:
        n = len(self.engines)
        if self.router is Router.ROUND_ROBIN:
            rank = self._turn % n
        else:
            rank = min(range(n), key=lambda i: (self._load[i], (i - self._turn) % n))
        self._turn += 1
        return rank

    # ---- replay -----------------------------------------------------------------------------
    def replay(self, trace: Trace, *, drain_timeout_s: float = 300.0,
               min_end_s: float = 0.0) -> FleetRun:
        """Send every request at its arrival time; run until all have finished (or
        ``drain_timeout_s`` after the last arrival), and in any case until ``min_end_s``: the
        bench's scoring window, in which a fleet whose requests drained early still trains."""
        t0, c0 = time.perf_counter(), time.process_time()
        records = [RequestTimes(i, r.arrival_s, r.prompt_tokens, r.output_tokens)
                   for i, r in enumerate(trace.requests)]
        self._left += len(records)
        for rec in records:
            self.clock.at(rec.arrival_s, lambda rec=rec: self._send(rec))
        for eng in self.engines:
            eng.kick()  # co-serving replicas start training before the first request
        last = max((r.arrival_s for r in records), default=0.0)
        self.clock.run(until=lambda: self._left == 0 and self.clock.now() >= min_end_s,
                       max_s=max(last + drain_timeout_s, min_end_s))
        if self._left == 0 and self.clock.now() < min_end_s:
            self.clock.advance_to(min_end_s)  # nothing left to run: idle until the window closes
        end = self.clock.now()
        return FleetRun(
            records, end, self._left > 0,
            [list(s) for s in self._steps], list(self.commits),
            [e.latency_model.online_error() if e.latency_model else () for e in self.engines],
            self.sync.wait_s if self.sync else 0.0, self.sync.rounds if self.sync else 0,
            self.clock.events_run, time.perf_counter() - t0, time.process_time() - c0)

    def _send(self, rec: RequestTimes) -> None:
        rank = self.route()
        rec.replica = rank
        self._load[rank] += 1
        rid = f"r{rec.index}"
        self._sent[rid] = rec
        self.engines[rank].add_request(
            [0] * rec.prompt_tokens,
            SamplingParams(max_tokens=rec.output_tokens, ignore_eos=True), request_id=rid)

    def _finished(self, rank: int, request_id: str) -> None:
        out = self.engines[rank].pop_finished(request_id)
        rec = self._sent.pop(request_id)
        rec.token_times_s, rec.finished = out.token_times_s, True
        self._load[rank] -= 1
        self._left -= 1

    def close(self) -> None:
        """Return every uncommitted sample to the pool (exactly once holds across runs)."""
        for eng in self.engines:
            eng.detach(drain=False, checkpoint=False)
