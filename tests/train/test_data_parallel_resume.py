"""Data-parallel checkpoints: rank 0 writes one checkpoint for the group, and resume re-forms a
group of any size from it.

Checked against the replicas' own ``OptimizerStep`` events (the independent record of what each
committed): the checkpoint's pool state is the union of every replica's commits of the epoch,
only rank 0 wrote checkpoints, and across the run that stopped and the run that resumed every
sample is committed exactly once per epoch, each resumed replica inside its new shard. A crafted
group checkpoint whose commits cover one replica's whole shard makes that replica hold back
(empty shares) while its peer trains the rest of the epoch."""

import functools
import json
import time

import pytest
import torch

from deltaserve.core.pool import SamplePool
from deltaserve.core.shard import DataShard
from deltaserve.model import AdapterWeights
from deltaserve.train.capture import training_only_step
from deltaserve.train.checkpoint_store import CheckpointStore, dataset_fingerprint, find_latest
from deltaserve.train.events import OptimizerStep
from deltaserve.train.facade import CoServer
from deltaserve.train.optim import OptimizerState
from tests.train import fixtures as fx
from tests.train.backward.test_data_parallel import LORA, free_port
from tests.train.test_data_parallel_coserve import SEED, run_replicas, settle, start, train_idle

NUM_SAMPLES = 9  # two shards of 5 and 4, one sample a step
NUM_EPOCHS = 2
STOP_AFTER_STEPS = 3  # mid-epoch 0 on both replicas


def run(cos: list[CoServer], stop_after: int | None) -> list[list[OptimizerStep]]:
    """Drive every replica as an idle host does, until ``stop_after`` global steps (then close
    without draining, checkpointing) or to the end (draining); returns each one's steps."""
    steps: list[list[OptimizerStep]] = [[] for _ in cos]
    errors: list[BaseException] = []

    def drive(rank: int) -> None:
        co = cos[rank]
        co.subscribe(lambda ev: steps[rank].append(ev) if isinstance(ev, OptimizerStep) else None)
        try:
            if stop_after is None:
                train_idle(co)
            else:
                deadline = time.monotonic() + 120
                # one capture at a time (the buffer holds about one sample), each trained
                while co.trainer.optimizer_steps < stop_after and time.monotonic() < deadline:
                    training_only_step(co, co.model, co.adapter)
                    settle(co)
            co.close(drain=stop_after is None, checkpoint=True, timeout_s=120.0)
        except BaseException as e:  # re-raised on the test thread
            errors.append(e)
            co.close(drain=False, checkpoint=False, timeout_s=5.0)

    run_replicas([functools.partial(drive, r) for r in range(len(cos))], errors)
    return steps


def by_epoch(*runs: list[list[OptimizerStep]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for steps in runs:
        for replica in steps:
            for ev in replica:
                out.setdefault(ev.epoch, []).extend(ev.sample_ids)
    return out


def pool_state(root) -> dict:
    latest = find_latest(root)
    assert latest is not None, "no checkpoint was written"
    return json.loads((latest / "trainer_state.json").read_text())["pool"]


@pytest.mark.parametrize("world_after", [2, 1])
def test_two_replicas_checkpoint_once_and_resume_as_any_group(base_path, tmp_path, world_after):
    samples = fx.samples(NUM_SAMPLES, seed=3)
    root = tmp_path / "ck"
    first = run(start(base_path, samples, free_port(), root=root), STOP_AFTER_STEPS)
    committed = by_epoch(first)
    assert set(committed) == {0}, "the first run was to stop mid-epoch 0"
    # one writer: rank 0's checkpoints, each rank's own log
    names = sorted(p.name for p in root.iterdir())
    assert names == sorted(["latest", "train_log.jsonl", "train_log.rank-1.jsonl",
                            *{p.name for p in root.glob("checkpoint-*")}])
    state = pool_state(root)
    assert "shard" not in state, "a group checkpoint is the whole dataset's"
    assert state["epoch"] == 0 and sorted(state["committed"]) == sorted(committed[0])
    assert state["samples_committed_total"] == len(committed[0])

    resumed = start(base_path, samples, free_port(), root=root, world_size=world_after)
    last = max(ev.step for replica in first for ev in replica)
    assert all(co.trainer.optimizer_steps == last + 1 for co in resumed)
    second = run(resumed, None)
    for rank, replica in enumerate(second):
        assert replica[0].step == last + 1, "the resumed group goes on from the checkpoint"
        shard = DataShard(rank, world_after, SEED)
        for ev in replica:  # each resumed replica trains inside its new shard
            assert set(ev.sample_ids) <= set(shard.ids(NUM_SAMPLES, ev.epoch))
    everything = by_epoch(first, second)
    for epoch in range(NUM_EPOCHS):
        assert sorted(everything[epoch]) == list(range(NUM_SAMPLES)), f"epoch {epoch}"
    assert all(co.book.progress().finished for co in resumed)
    assert all(torch.equal(co.adapter.flat, resumed[0].adapter.flat) for co in resumed)
    assert pool_state(root)["epoch"] == NUM_EPOCHS


def test_a_replica_whose_shard_the_checkpoint_covers_holds_back(base_path, tmp_path):
    """A group checkpoint (written by hand, as rank 0 would) that committed all of rank 1's
    shard of epoch 0 and one of rank 0's: rank 1 sends empty shares until rank 0 has trained
    the epoch's rest, then both train epoch 1."""
    samples = fx.samples(NUM_SAMPLES, seed=3)
    root = tmp_path / "ck"
    shards = [DataShard(r, 2, SEED).ids(NUM_SAMPLES, 0) for r in range(2)]
    pool = SamplePool([s.num_tokens for s in samples], num_epochs=NUM_EPOCHS, seed=SEED)
    done = [*shards[1], shards[0][0]]
    pool.claim(done)
    pool.commit(done)
    adapter = AdapterWeights(fx.model(base_path).config, LORA).init_peft_(SEED)
    CheckpointStore(root).save(0, adapter, OptimizerState(adapter.numel),
                               pool.state_dict(), str(base_path), dataset_fingerprint(samples))

    cos = start(base_path, samples, free_port(), root=root)
    assert [co.book.pool.epoch for co in cos] == [0, 1]
    steps = run(cos, None)
    epoch0 = [[ev for ev in replica if ev.epoch == 0] for replica in steps]
    assert sorted(i for ev in epoch0[0] for i in ev.sample_ids) == sorted(shards[0][1:])
    # rank 1 held back: it took part in rank 0's steps with empty shares, and its first real
    # step is epoch 1's
    assert [len(ev.sample_ids) for ev in steps[1][:len(epoch0[0])]] == [0] * len(epoch0[0])
    for rank in range(2):
        got = [i for ev in steps[rank] if ev.epoch == 1 for i in ev.sample_ids]
        assert sorted(got) == sorted(DataShard(rank, 2, SEED).ids(NUM_SAMPLES, 1))
