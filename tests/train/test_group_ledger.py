"""The group's ledger against the replicas' own commits: it commits every global step's
samples, whichever replica trained them, ends its epochs where the dataset's end, and refuses a
sample the group trains twice in one epoch."""

import pytest

from deltaserve.core.pool import PoolStateError, SamplePool
from deltaserve.core.shard import DataShard
from deltaserve.train.group_ledger import GroupLedger

LENGTHS = [3, 1, 4, 1, 5, 9, 2]


def test_the_ledger_holds_every_replicas_commits_and_ends_the_epoch_with_the_dataset():
    shards = [DataShard(r, 2, seed=1) for r in range(2)]
    pools = [SamplePool(LENGTHS, num_epochs=2, seed=1, shard=s) for s in shards]
    ledger = GroupLedger(pools[1])
    for _ in range(len(LENGTHS)):  # one sample per replica per global step
        step = [ids for p in pools if not p.epoch for ids in p.claim_first(1)]
        for p in pools:
            mine = [i for i in step if i in p.shard.ids(len(LENGTHS), 0)]
            if mine:
                p.commit(mine)
        ledger.record(step)
        if ledger.epoch == 1:
            break
    assert all(p.epoch == 1 for p in pools) and ledger.epoch == 1
    state = ledger.state_dict()
    assert "shard" not in state and state["committed"] == []
    assert state["tokens_committed_total"] == sum(LENGTHS)
    ledger.record([])  # an all-empty step changes nothing
    assert ledger.state_dict() == state


def test_a_sample_the_group_trains_twice_in_an_epoch_is_refused():
    ledger = GroupLedger(SamplePool(LENGTHS, seed=1, shard=DataShard(0, 2, seed=1)))
    ledger.record([0, 5])
    with pytest.raises(PoolStateError, match="committed"):
        ledger.record([5])
