"""The replicas' step agreement (train/group_steps.py) against a brute-force model of the group:
N replicas with sharded pools, captures and step sizes drawn at random, closes at random, and
the collective modelled exactly (a global step happens once every replica has submitted its
share). Whatever the order, no replica is ever left waiting for a step its peers never send,
no global step mixes two epochs, every sample is trained exactly once per epoch across the
replicas, and every replica takes the same number of steps in each epoch."""

import random
from collections import Counter

import pytest

from deltaserve.core.pool import SamplePool
from deltaserve.core.shard import DataShard
from deltaserve.train.group_steps import GroupSteps, Share, Votes


class Replica:
    def __init__(self, rank: int, world: int, lengths, num_epochs, seed: int):
        self.rank = rank
        self.pool = SamplePool(lengths, num_epochs=num_epochs, seed=seed,
                               shard=DataShard(rank, world, seed))
        self.group = GroupSteps(world)
        self.ready: list[int] = []
        self.closing = False
        self.submitted: tuple[tuple[int, ...], Votes] | None = None
        self.steps_by_epoch: Counter[int] = Counter()

    @property
    def leaving(self) -> bool:
        return self.closing or self.pool.progress().finished

    def share(self) -> Share:
        return self.group.share(bool(self.ready), self.leaving)

    def submit(self, real: bool, rng: random.Random) -> None:
        take: tuple[int, ...] = ()
        if real:  # a batch of whatever size its captures filled: one sample, or all
            k = len(self.ready) if self.closing else rng.randint(1, len(self.ready))
            take, self.ready = tuple(self.ready[:k]), self.ready[k:]
        self.submitted = (take, self.group.votes(self.pool.progress(), len(take), self.closing))


def collective(replicas) -> None:
    """Every replica submitted: the all-reduce sums the votes, each replica commits."""
    shares = [r.submitted for r in replicas]
    opened = sum(v.epoch_open for _, v in shares)
    staying = sum(v.staying for _, v in shares)
    epochs = {r.pool.epoch for r, (ids, _) in zip(replicas, shares, strict=True) if ids}
    assert len(epochs) <= 1, f"a global step mixes epochs {epochs}"
    stepped = any(ids for ids, _ in shares)
    for r, (ids, votes) in zip(replicas, shares, strict=True):
        if stepped and epochs:
            r.steps_by_epoch[next(iter(epochs))] += 1
        if ids:
            r.pool.commit(ids)
        r.group.observe(votes, opened, staying)
        r.submitted = None


def simulate(world: int, num_samples: int, num_epochs, seed: int, close_p: float):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 9) for _ in range(num_samples)]
    reps = [Replica(r, world, lengths, num_epochs, seed) for r in range(world)]
    ledger: Counter[tuple[int, int]] = Counter()  # (epoch, sample) -> times trained
    for _ in range(100_000):
        if all(r.submitted is not None for r in reps):
            for r in reps:
                for sid in r.submitted[0]:
                    ledger[(r.pool.epoch, sid)] += 1
            collective(reps)
            continue
        moves = []
        for r in reps:
            if r.submitted is not None:
                continue
            share = r.share()
            if share is Share.EMPTY:
                moves.append((r, "empty"))
            elif share is Share.REAL:
                moves.append((r, "real"))
            if not r.closing and len(r.pool) > 0:
                moves.append((r, "capture"))
            if not r.closing and close_p and rng.random() < close_p:
                moves.append((r, "close"))
        if not moves:
            waiting = [r.rank for r in reps if r.submitted is not None]
            assert not waiting, f"replicas {waiting} wait for a step their peers never send"
            return reps, ledger
        r, move = rng.choice(moves)
        if move == "capture":
            r.ready += r.pool.claim_first(rng.randint(1, 3))
        elif move == "close":
            r.closing = True
        else:
            r.submit(move == "real", rng)
    raise AssertionError("the group never settled")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("seed", range(40))
def test_replicas_finish_every_epoch_together_and_train_each_sample_once(world, seed):
    num_samples = 2 * world + 1 + seed % 5  # odd and even sizes: shards differ by one
    reps, ledger = simulate(world, num_samples, num_epochs=3, seed=seed, close_p=0.0)
    for r in reps:
        assert r.pool.progress().finished and r.group.done and not r.ready
    assert sorted(ledger) == [(e, s) for e in range(3) for s in range(num_samples)]
    assert set(ledger.values()) == {1}
    # every replica took part in every step, and the epochs ended at the same step
    assert all(r.steps_by_epoch == reps[0].steps_by_epoch for r in reps)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("seed", range(40))
def test_replicas_closing_at_any_time_leave_nobody_waiting(world, seed):
    """Endless training (no last epoch): the group ends only as the replicas close, in any
    order, some with captured samples still to train."""
    reps, ledger = simulate(world, 2 * world + 1, num_epochs=None, seed=seed, close_p=0.02)
    assert all(r.closing and r.group.done for r in reps)
    assert max(ledger.values(), default=1) == 1


def test_one_replica_out_of_work_contributes_empty_shares_until_its_peer_is():
    """Brute force by hand: rank 0's shard has one sample more; rank 1 finishes its share of
    the epoch first and must answer its peer's last step with an empty share."""
    g = GroupSteps(2)
    assert g.share(has_ready=False, leaving=False) is Share.NONE
    lengths = [3] * 5
    pool = SamplePool(lengths, num_epochs=1, shard=DataShard(1, 2))  # 2 of the 5 samples
    ids = pool.claim_first(2)
    votes = g.votes(pool.progress(), len(ids), closing=False)
    assert votes == Votes(epoch_open=False, staying=False)  # its last step of its last epoch
    pool.commit(ids)
    g.observe(votes, epoch_open=1, staying=1)  # rank 0 has a sample left
    assert g.holds_back() and g.share(False, leaving=True) is Share.EMPTY
    empty = g.votes(pool.progress(), 0, closing=False)
    assert empty == Votes(False, False)
    g.observe(empty, epoch_open=0, staying=0)
    assert g.done and g.share(True, leaving=True) is Share.NONE
