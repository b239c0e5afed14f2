"""Data-parallel sample shards: every sample trained exactly once per epoch across the replicas'
pools, checked by brute force over epochs, world sizes and dataset sizes."""

import random
from collections import Counter

import pytest

from deltaserve.core.errors import InputError
from deltaserve.core.pool import PoolStateError, SamplePool
from deltaserve.core.shard import DataShard

CASES = [(w, n) for w in (1, 2, 3, 4) for n in (w, w + 1, 7, 23) if n >= w]


@pytest.mark.parametrize("world_size, num_samples", CASES)
def test_shards_of_an_epoch_partition_the_dataset(world_size, num_samples):
    for epoch in range(5):
        shards = [DataShard(r, world_size, seed=3).ids(num_samples, epoch)
                  for r in range(world_size)]
        flat = [i for s in shards for i in s]
        assert sorted(flat) == list(range(num_samples))  # union: all; no id twice: disjoint
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
        # every replica computes every shard alike: the split depends on (seed, epoch, n) only
        assert shards == [DataShard(r, world_size, seed=3).ids(num_samples, epoch)
                          for r in range(world_size)]


def test_shards_change_between_epochs_and_seeds():
    by_epoch = {DataShard(0, 2).ids(23, e) for e in range(5)}
    assert len(by_epoch) > 1
    assert DataShard(0, 2, seed=1).ids(23, 0) != DataShard(0, 2, seed=2).ids(23, 0)


def _train(pools, rng, ledger, num_epochs):
    """Drive every replica's pool to its end with random claims, releases (aborted steps, lost
    backwards) and commits, interleaving the replicas; ``ledger`` counts (epoch, id) commits."""
    live = list(pools)
    while live:
        pool = rng.choice(live)
        if pool.progress().finished:
            live.remove(pool)
            continue
        epoch = pool.epoch
        ids = pool.claim_first(rng.randint(1, 4))
        assert ids  # an unfinished pool always has work
        if rng.random() < 0.3:
            pool.release(ids)
            continue
        pool.commit(ids)
        ledger.update((epoch, i) for i in ids)
    assert all(p.epoch == num_epochs for p in pools)


@pytest.mark.parametrize("world_size, num_samples", CASES)
def test_replicas_pools_train_each_sample_once_per_epoch(world_size, num_samples):
    num_epochs = 3
    lengths = [random.Random(num_samples).randint(1, 9) for _ in range(num_samples)]
    pools = [SamplePool(lengths, num_epochs=num_epochs, seed=5,
                        shard=DataShard(r, world_size, seed=5)) for r in range(world_size)]
    ledger: Counter = Counter()
    _train(pools, random.Random(world_size * 100 + num_samples), ledger, num_epochs)
    assert ledger == Counter({(e, i): 1 for e in range(num_epochs) for i in range(num_samples)})
    assert sum(p.progress().samples_committed_total for p in pools) == num_epochs * num_samples


def test_a_pool_cannot_claim_another_replicas_sample():
    pool = SamplePool([3] * 10, shard=DataShard(1, 2))
    mine = set(DataShard(1, 2).ids(10, 0))
    other = next(i for i in range(10) if i not in mine)
    assert {i for i, _ in pool.iter_available()} == mine
    assert len(pool) == pool.progress().num_samples == 5
    with pytest.raises(PoolStateError, match="elsewhere"):
        pool.claim([other])


def test_sharded_checkpoint_resumes_the_epoch_in_order():
    lengths = [2, 5, 5, 5, 3, 3, 7, 1, 5]
    shard = DataShard(0, 2, seed=1)
    pool = SamplePool(lengths, num_epochs=2, seed=1, shard=shard)
    pool.commit(pool.claim_first(len(pool)))  # epoch 0 done
    first = pool.claim_first(2)
    pool.commit(first)
    rest = [i for i, _ in pool.iter_available()]
    state = pool.state_dict()

    again = SamplePool(lengths, num_epochs=2, seed=1, shard=shard)
    again.load_state_dict(state)
    assert again.epoch == 1 and [i for i, _ in again.iter_available()] == rest
    again.commit(again.claim_first(len(again)))
    done = again.state_dict()
    assert again.progress().finished
    finished = SamplePool(lengths, num_epochs=2, seed=1, shard=shard)
    finished.load_state_dict(done)  # a finished pool's committed ids are the last epoch's
    assert finished.progress().finished and len(finished) == 0

    with pytest.raises(InputError) as e:
        SamplePool(lengths, num_epochs=2, seed=1, shard=DataShard(1, 2, seed=1)) \
            .load_state_dict(state)
    assert e.value.field == "pool.shard"
    with pytest.raises(InputError) as e:
        SamplePool(lengths, num_epochs=2, seed=1).load_state_dict(state)
    assert e.value.field == "pool.shard"


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("covers_a_shard", [False, True])
def test_a_group_checkpoint_resumes_any_number_of_replicas(world_size, covers_a_shard):
    """The group's (unsharded) state of a mid-epoch checkpoint, loaded by ``world_size``
    replicas: each takes its new shard less what the group committed, the rest of the run
    trains every sample once per epoch (brute force), and a replica whose whole shard the group
    committed starts in the next epoch."""
    num_samples, num_epochs = 11, 2
    lengths = [random.Random(num_samples).randint(1, 9) for _ in range(num_samples)]
    rng = random.Random(world_size)
    if covers_a_shard:
        shard0 = DataShard(0, world_size, seed=5).ids(num_samples, 0)
        rest = [i for i in range(num_samples) if i not in shard0]
        # one replica's shard is the dataset: the group's epoch then lacks one sample
        done = [*shard0, *rest[:1]] if world_size > 1 else list(shard0[:-1])
    else:
        done = rng.sample(range(num_samples), k=5)
    group = SamplePool(lengths, num_epochs=num_epochs, seed=5)  # what the group's ledger holds
    group.claim(done)
    group.commit(done)
    pools = [SamplePool(lengths, num_epochs=num_epochs, seed=5,
                        shard=DataShard(r, world_size, seed=5)) for r in range(world_size)]
    for pool in pools:
        pool.load_state_dict(group.state_dict())
        assert pool.progress().samples_committed_total == 0  # its own commits from here on
    open_ = [{i for i, _ in p.iter_available()} for p in pools if p.epoch == 0]
    assert sorted(i for ids in open_ for i in ids) == sorted(set(range(num_samples)) - set(done))
    if covers_a_shard and world_size > 1:
        assert pools[0].epoch == 1 and len(pools[0]) == len(DataShard(0, world_size, seed=5)
                                                            .ids(num_samples, 1))
    ledger: Counter = Counter((0, i) for i in done)
    _train(pools, rng, ledger, num_epochs)
    assert ledger == Counter({(e, i): 1 for e in range(num_epochs) for i in range(num_samples)})


@pytest.mark.parametrize("kwargs, field", [
    (dict(rank=2, world_size=2), "rank"),
    (dict(rank=-1, world_size=2), "rank"),
    (dict(rank=0, world_size=0), "world_size"),
])
def test_bad_shard_names_the_field(kwargs, field):
    with pytest.raises(InputError) as e:
        DataShard(**kwargs)
    assert e.value.field == field


def test_fewer_samples_than_replicas_is_refused():
    with pytest.raises(InputError) as e:
        SamplePool([4, 4], shard=DataShard(0, 3))
    assert e.value.field == "dataset"
