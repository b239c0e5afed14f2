"""One simulated GPU shared by host steps and the backward: the grant, the contention between
them, and how far the backward job has got.

The backward job's local work (recompute + backward of every layer, top-down, then the loss) is
measured in *standalone seconds*: the time it takes with the device to itself. It progresses at
a rate that depends on what else runs (the grant policy, :class:`~deltaserve.train.config.
GrantPolicy`):

* ``prefill`` (GPUs). With the grant set and no host step, rate 1. Beside a host step with the
  grant set (decode-only steps), rate ``backward_share_under_decode`` (σ), and the step runs
  ``1 + decode_slowdown_under_backward`` (1 + s) times slower while they overlap. A step that
  clears the grant (prefill or fine-tuning rows) starts at once; the backward finishes the layer
  unit it is in beside it (the same σ and s: the tail of one unit, ≤ 2 ms here) and parks at the
  layer boundary until the grant is set again.
* ``exclusive`` (time slicing: LLMStation's tasklets fused into inference iterations). The
  backward computes only while no host step runs (idle time, and the time a host lends it before
  a step); a step clears the grant and first waits for the backward to reach its layer boundary
  (at rate 1), then runs alone.
* ``partition`` (CPUs): the backward owns its own cores; rate 1 always, steps never slowed.

After the local work the job waits for the gradient all-reduce of its data-parallel group (if
any) and ends with one optimizer step; those are timed by the caller (:meth:`reduce_until`).
Progress is piecewise linear: every change of state first books the progress made so far.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum, auto

from deltaserve.core.errors import InputError
from deltaserve.hosts.sim.clock import SimClock
from deltaserve.hosts.sim.modelled import ModelledParams
from deltaserve.train.config import GrantPolicy

SIMULATED_POLICIES = (GrantPolicy.PREFILL, GrantPolicy.EXCLUSIVE, GrantPolicy.PARTITION)


class Phase(Enum):
    LOCAL = auto()  # computing its layers and loss on this device
    WAIT = auto()  # local work done; waiting for the group's all-reduce
    REDUCE = auto()  # all-reduce and optimizer step under way; ends at ``complete_s``


@dataclass(frozen=True)
class JobTiming:
    """Standalone seconds of one backward job: ``unit_s`` per layer (recompute, backward, the
    grant poll at its boundary), ``num_layers`` of them, then ``head_s`` (final norm, LM head
    and loss, forward and backward; not interruptible) and, after the all-reduce,
    ``optimizer_s``."""

    unit_s: float
    num_layers: int
    head_s: float
    optimizer_s: float

    @property
    def local_s(self) -> float:
        return self.unit_s * self.num_layers + self.head_s

    def next_boundary(self, done_s: float) -> float:
        """The end of the layer unit ``done_s`` is in (``done_s`` itself at a boundary); past
        the last layer, the end of the local work."""
        k = math.ceil(done_s / self.unit_s - 1e-9)
        return self.local_s if k >= self.num_layers else k * self.unit_s


@dataclass
class _Job:
    timing: JobTiming
    started_s: float
    phase: Phase = Phase.LOCAL
    done_s: float = 0.0  # standalone seconds of local work done at ``at_s``
    at_s: float = 0.0
    rate: float = 0.0
    cap_s: float = 0.0  # progress stops here (a layer boundary to park at, or the end)
    parked_s: float = 0.0  # wall seconds at rate 0 while in LOCAL
    complete_s: float = math.inf


class GpuTimeline:
    def __init__(self, clock: SimClock, policy: GrantPolicy, params: ModelledParams):
        if policy not in SIMULATED_POLICIES:
            raise InputError("grant_policy", policy.value, "the simulated host models "
                             + " and ".join(p.value for p in SIMULATED_POLICIES))
        self.clock = clock
        self.policy = policy
        share, slow = params.backward_share_under_decode, params.decode_slowdown_under_backward
        self._share, self._slowdown = (1.0, 0.0) if policy is GrantPolicy.PARTITION \
            else (share, slow)
        self.exclusive = policy is GrantPolicy.EXCLUSIVE
        self.grant = True
        self.step_running = False
        self.job: _Job | None = None
        self.version = 0  # bumps whenever the job's next change of state may have moved

    # ---- the job ----------------------------------------------------------------------------
    def start_job(self, timing: JobTiming) -> None:
        now = self.clock.now()
        self.job = _Job(timing, now, at_s=now)
        self._retarget()

    def local_done_at(self) -> float:
        """When the local work completes at the current rate (inf if parked or not local)."""
        j = self.job
        if j is None or j.phase is not Phase.LOCAL or j.cap_s < j.timing.local_s:
            return math.inf
        if j.rate <= 0:
            return math.inf if j.done_s < j.timing.local_s else j.at_s
        return j.at_s + (j.timing.local_s - j.done_s) / j.rate

    def finish_local(self) -> None:
        """The local work is done (at the current time): wait for the group."""
        j = self._book()
        assert j.done_s >= j.timing.local_s - 1e-12, (j.done_s, j.timing.local_s)
        j.phase, j.rate = Phase.WAIT, 0.0
        self.version += 1

    def reduce_until(self, complete_s: float) -> None:
        """The group's all-reduce started; the job (optimizer step included) ends then."""
        j = self._book()
        j.phase, j.complete_s = Phase.REDUCE, complete_s
        self.version += 1

    @property
    def job_completed(self) -> bool:
        """The job in flight has completed by now (its outcome not yet taken)."""
        j = self.job
        return j is not None and j.phase is Phase.REDUCE and j.complete_s <= self.clock.now()

    def take_completed(self) -> _Job | None:
        """The job, if it has completed by now (it leaves the device)."""
        j = self.job
        if j is None or j.phase is not Phase.REDUCE or j.complete_s > self.clock.now():
            return None
        self.job = None
        self.version += 1
        return j

    # ---- host steps and the grant -----------------------------------------------------------
    def begin_step(self, base_s: float) -> float:
        """A host step that takes ``base_s`` alone starts now; returns how long it takes beside
        the backward (and sets the backward's rate for its duration)."""
        j = self._book()
        self.step_running = True
        if j is None or j.phase is not Phase.LOCAL:
            return base_s
        target = j.timing.local_s if self.grant else j.timing.next_boundary(j.done_s)
        work = target - j.done_s
        if work <= 1e-15:
            self._set_rate(j, 0.0, j.done_s)
            return base_s
        if self.exclusive:  # the step waits for the backward's layer boundary, then runs alone
            self._set_rate(j, 1.0, j.timing.next_boundary(j.done_s))
            return (j.cap_s - j.done_s) + base_s
        self._set_rate(j, self._share, target)
        overlap_s = work / self._share
        stretched = base_s * (1.0 + self._slowdown)
        if overlap_s >= stretched:
            return stretched
        # the backward reaches its target first: the rest of the step runs alone
        return overlap_s + (base_s - overlap_s / (1.0 + self._slowdown))

    def end_step(self) -> None:
        self._book()
        self.step_running = False
        self._retarget()

    def set_grant(self, grant: bool) -> None:
        if grant == self.grant or self.policy is GrantPolicy.PARTITION:
            return  # a partitioned backward never yields
        self._book()
        self.grant = grant
        if not self.step_running:  # during a step the rate was fixed when it began
            self._retarget()

    # ---- internals --------------------------------------------------------------------------
    def _book(self) -> _Job | None:
        """Book the progress made up to now."""
        j = self.job
        if j is None:
            return None
        now = self.clock.now()
        if j.phase is Phase.LOCAL and now > j.at_s:
            moved = min(j.cap_s, j.done_s + j.rate * (now - j.at_s))
            if j.rate <= 0 or moved >= j.cap_s:
                reached = j.at_s if j.rate <= 0 else j.at_s + (j.cap_s - j.done_s) / j.rate
                if j.cap_s < j.timing.local_s:
                    j.parked_s += now - reached
            j.done_s = moved
        j.at_s = now
        return j

    def _retarget(self) -> None:
        """Rate outside host steps: the whole device while the grant is set; with it cleared,
        on to the layer boundary and park there."""
        j = self.job
        if j is None or j.phase is not Phase.LOCAL:
            return
        target = j.timing.local_s if self.grant else j.timing.next_boundary(j.done_s)
        self._set_rate(j, 1.0, target)

    def _set_rate(self, j: _Job, rate: float, cap_s: float) -> None:
        j.rate, j.cap_s = rate, cap_s
        self.version += 1
