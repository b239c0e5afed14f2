"""The parent's handle on the backward process: submit, poll, notice death, restart.

One job is in flight at a time. If the process dies, the in-flight job is reported lost (its
samples go back to the pool) and a new process starts from the last published adapter and
optimizer state (not for a data-parallel replica, whose peers' group a new process cannot
join: its co-server stops training); inference never waits on any of this.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass

import torch.multiprocessing as mp

from deltaserve.train.backward.grant import Grant
from deltaserve.train.backward.messages import (
    BackwardDone,
    BackwardFailed,
    BackwardJob,
    EvalDone,
    EvalJob,
    LayerDone,
    Stop,
    WorkerReady,
)
from deltaserve.train.backward.worker import SharedState, WorkerSpec, worker_main
from deltaserve.train.publish import roll_back


@dataclass(frozen=True)
class WorkerLost:
    """The process died with ``job`` in flight. ``rolled_back``: it had begun publishing the
    job's step, and the shared state was restored to the last committed step."""

    job: BackwardJob | EvalJob
    exitcode: int | None
    rolled_back: bool = False


BackwardEvent = BackwardDone | EvalDone | BackwardFailed | WorkerLost | LayerDone

# The usual cause when DeltaServe runs from a script: the process is spawned, so it imports the
# script again, which starts a second engine and backward inside the child, and that fails.
_MAIN_GUARD_HINT = (" If DeltaServe runs from a script, put the script's entry point under "
                    "`if __name__ == \"__main__\":` (the backward runs in a spawned process, "
                    "which imports the main module again); its own error is printed above.")


class BackwardProcess:
    def __init__(self, spec: WorkerSpec, shared: SharedState):
        self._ctx = mp.get_context("spawn")
        self.spec = spec
        self.shared = shared
        self.grant = Grant(self._ctx)
        self.parked = self._ctx.Value("b", 1, lock=False)
        self.in_flight: BackwardJob | EvalJob | None = None
        self.restarts = 0
        self.ready = False  # the current process has reported WorkerReady
        self._start()

    def _start(self) -> None:
        # Fresh queues: a process killed mid-put can leave a queue's lock held. The old ones
        # are abandoned without joining their feeder threads, which may block forever on a pipe
        # nobody reads.
        for old in (getattr(self, "_jobs", None), getattr(self, "_results", None)):
            if old is not None:
                old.cancel_join_thread()
                old.close()
        self._jobs = self._ctx.Queue()
        self._results = self._ctx.Queue()
        self.ready = False
        self.process = self._ctx.Process(
            target=worker_main, name="deltaserve-backward", daemon=True,
            args=(self.spec, self.shared, self._jobs, self._results, self.grant, self.parked))
        self.process.start()

    @property
    def busy(self) -> bool:
        return self.in_flight is not None

    def submit(self, job: BackwardJob | EvalJob) -> None:
        if self.in_flight is not None:
            raise RuntimeError(f"backward step {self.in_flight.step} is still in flight")
        self.in_flight = job
        self._jobs.put(job)

    def poll(self, timeout_s: float = 0.0) -> list[BackwardEvent]:
        """Messages from the process (waiting up to ``timeout_s`` for the first), and
        :class:`WorkerLost` if it died with a job in flight (a new process is then started)."""
        events = self._read(timeout_s)
        if self.in_flight is not None and not self.process.is_alive():
            events.append(self._lost())
            self.parked.value = 1
            # a data-parallel replica's new process could not join its peers' group (its
            # members are fixed when it forms: a newcomer would wait out the rendezvous, or
            # pair its start-up broadcast with their all-reduce): none is started
            if not self.spec.data_parallel.distributed:
                self.restarts += 1
                self._start()
        return events

    def _read(self, timeout_s: float) -> list[BackwardEvent]:
        events: list[BackwardEvent] = []
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self._results.get(timeout=max(0.0, deadline - time.monotonic())) \
                    if timeout_s > 0 and not events else self._results.get_nowait()
            except queue.Empty:
                return events
            if isinstance(msg, WorkerReady):
                self.ready = True
                continue
            if not isinstance(msg, LayerDone) and self.in_flight is not None \
                    and msg.step == self.in_flight.step:
                self.in_flight = None
            events.append(msg)

    def _lost(self) -> WorkerLost:
        """The in-flight job of a dead process: restore the committed state if it had begun
        publishing (``publish.roll_back``)."""
        assert self.in_flight is not None
        sh = self.shared
        job = self.in_flight
        # validation never publishes: there is nothing of it to undo
        rolled_back = isinstance(job, BackwardJob) and roll_back(
            job.step, sh.adapter_flat, sh.optimizer, sh.guard)
        lost = WorkerLost(job, self.process.exitcode, rolled_back)
        self.in_flight = None
        return lost

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Block until the process has started (before serving, so that its start-up does not
        compete with the first steps). Raises if it dies or does not report in time."""
        deadline = time.monotonic() + timeout_s
        while not self.ready:
            if not self.process.is_alive():
                raise RuntimeError(f"the backward process exited during start-up "
                                   f"(exit code {self.process.exitcode}).{_MAIN_GUARD_HINT}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the backward process did not start in {timeout_s:.0f} s")
            for ev in self.poll(timeout_s=0.05):
                raise RuntimeError(f"unexpected {type(ev).__name__} before any job: {ev}")

    def wait_parked(self, timeout_s: float) -> bool:
        """After clearing the grant: wait until the process stops computing (it finishes the
        layer in progress). ``False`` if it is still busy after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.parked.value and self.in_flight is not None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)
        return True

    def wait(self, timeout_s: float = 600.0) -> list[BackwardEvent]:
        """Block until the in-flight job (if any) ends; returns every event meanwhile."""
        events: list[BackwardEvent] = []
        deadline = time.monotonic() + timeout_s
        while self.in_flight is not None and time.monotonic() < deadline:
            events += self.poll(timeout_s=0.05)
        return events

    def stop(self, timeout_s: float = 30.0) -> list[BackwardEvent]:
        """Stop the process, killing it after ``timeout_s`` (a hung backward). Returns what it
        reported before it stopped and, for a job still in flight, :class:`WorkerLost` with the
        shared state rolled back to the last committed step: nothing half-published survives."""
        self.grant.set()  # a paused worker must be able to finish to see Stop
        if self.process.is_alive():
            self._jobs.put(Stop())
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        events = self._read(0.0)
        if self.in_flight is not None:
            events.append(self._lost())
        return events
