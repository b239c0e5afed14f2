"""Fault: one data-parallel replica's backward process is SIGKILLed mid-epoch (just after it
committed a step, while its peer may already wait in the next step's all-reduce).

Checked against the sample ledger, on both replicas: every sample is committed at most once in
its epoch (by the replicas' ``OptimizerStep`` events), every sample of the replica's shard not
committed is back in its pool, available (none claimed, none lost), and the pool's committed
set is exactly what the events committed. Both replicas stop training with a
:class:`TrainingStopped` naming the group (a restarted backward cannot rejoin it), soon after
the kill rather than after retries, and neither asks its host for another training step."""

import functools
import os
import signal
import time

import pytest

from deltaserve.core.shard import DataShard
from deltaserve.train.events import OptimizerStep, TrainingEvent, TrainingStopped
from deltaserve.train.facade import CoServer
from tests.train import fixtures as fx
from tests.train.backward.test_data_parallel import free_port
from tests.train.test_data_parallel_coserve import SEED, run_replicas, start, train_idle

NUM_SAMPLES = 9  # shards of 5 and 4, one sample a step
NUM_EPOCHS = 2
KILL_AFTER_STEP = 1  # mid-epoch 0 on both replicas
GROUP_TIMEOUT_S = 20.0
DRIVE_S = 120.0  # how long a replica may take to train or give up


def drive(co: CoServer, events: list[TrainingEvent], errors: list[BaseException]) -> None:
    """Train as an idle host does until nothing is pending (trained, or training stopped)."""
    try:
        train_idle(co, time.monotonic() + DRIVE_S)
        co.close(drain=False, checkpoint=False, timeout_s=30.0)
    except BaseException as e:  # re-raised on the test thread
        errors.append(e)
        co.close(drain=False, checkpoint=False, timeout_s=5.0)


def killer(co: CoServer, killed: list[float]):
    """A listener that SIGKILLs ``co``'s backward process once step ``KILL_AFTER_STEP``
    commits."""
    def on_event(ev: TrainingEvent) -> None:
        if isinstance(ev, OptimizerStep) and ev.step == KILL_AFTER_STEP and not killed:
            os.kill(co.trainer.backward.process.process.pid, signal.SIGKILL)
            killed.append(time.monotonic())
    return on_event


def check_ledger(co: CoServer, rank: int, events: list[TrainingEvent]) -> None:
    """At most once per epoch, and whatever was not committed is back in the pool."""
    shard = DataShard(rank, 2, SEED)
    committed: dict[int, list[int]] = {}
    for ev in events:
        if isinstance(ev, OptimizerStep):
            committed.setdefault(ev.epoch, []).extend(ev.sample_ids)
    pool = co.book.pool
    epoch = pool.epoch
    for e, ids in committed.items():
        assert len(ids) == len(set(ids)), f"rank {rank} epoch {e}: a sample committed twice"
        assert set(ids) <= set(shard.ids(NUM_SAMPLES, e)), f"rank {rank}: outside its shard"
        if e < epoch:  # a finished epoch committed its whole shard
            assert sorted(ids) == sorted(shard.ids(NUM_SAMPLES, e))
    assert pool.progress().samples_claimed == 0, f"rank {rank}: samples left claimed"
    state = pool.state_dict()
    assert sorted(state["committed"]) == sorted(committed.get(epoch, []))
    available = {sid for sid, _ in pool.iter_available()}
    assert available == set(shard.ids(NUM_SAMPLES, epoch)) - set(committed.get(epoch, [])), \
        f"rank {rank}: a sample neither committed nor back in the pool"


@pytest.mark.parametrize("victim", [0, 1])
def test_killing_a_replicas_backward_loses_and_doubles_no_sample(base_path, victim):
    samples = fx.samples(NUM_SAMPLES, seed=3)
    cos = start(base_path, samples, free_port(), timeout_s=GROUP_TIMEOUT_S)
    events: list[list[TrainingEvent]] = [[], []]
    errors: list[BaseException] = []
    killed: list[float] = []
    for r, co in enumerate(cos):
        co.subscribe(events[r].append)
    cos[victim].subscribe(killer(cos[victim], killed))
    run_replicas([functools.partial(drive, co, events[r], errors) for r, co in enumerate(cos)],
                 errors, DRIVE_S + 60)
    assert killed, "the victim never committed the step after which it is killed"
    for r, co in enumerate(cos):
        check_ledger(co, r, events[r])
        stopped = [ev for ev in events[r] if isinstance(ev, TrainingStopped)]
        assert len(stopped) == 1, f"rank {r}: {events[r]}"
        assert "data-parallel" in stopped[0].reason
        # given up at the first lost step (a retry cannot succeed), well before the group's
        # timeout repeats: at most one timeout after the kill
        assert stopped[0].at_s - killed[0] < GROUP_TIMEOUT_S + 10
        assert co.failure is not None and not co.wants_step()
        assert "lost a member" in str(co.failure) and "in a row" not in str(co.failure)
    # both stopped mid-epoch 0: neither trained its shard of it
    assert all(co.book.pool.epoch == 0 for co in cos)
