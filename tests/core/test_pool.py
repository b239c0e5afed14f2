from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve.core import InputError, PoolStateError, SamplePool


def test_candidates_in_increasing_length():
    pool = SamplePool([5, 3, 9, 3, 1], seed=1)
    lengths = [n for _, n in pool.iter_available()]
    assert lengths == sorted(lengths) == [1, 3, 3, 5, 9]
    assert pool.smallest_available() == 1


def test_claim_commit_release_and_epochs():
    pool = SamplePool([2, 4, 6], num_epochs=2)
    pool.claim([0, 1])
    assert len(pool) == 1 and pool.smallest_available() == 6
    pool.release([1])
    pool.commit([0])
    assert [sid for sid, _ in pool.iter_available()] == [1, 2]
    pool.claim([1, 2])
    pool.commit([1, 2])
    p = pool.progress()
    assert p.epoch == 1 and p.samples_committed == 0 and p.tokens_committed_total == 12
    assert len(pool) == 3
    pool.claim([0, 1, 2])
    pool.commit([0, 1, 2])
    assert pool.progress().finished and pool.is_empty and len(pool) == 0


def test_protocol_violations():
    pool = SamplePool([1, 2])
    with pytest.raises(PoolStateError):
        pool.commit([0])
    pool.claim([0])
    with pytest.raises(PoolStateError):
        pool.claim([0])
    with pytest.raises(PoolStateError):
        pool.release([1])
    with pytest.raises(PoolStateError):
        pool.claim([7])


def test_commit_and_release_reject_duplicate_ids():
    pool = SamplePool([1, 2, 3])
    pool.claim([0, 1])
    with pytest.raises(PoolStateError, match="duplicate"):
        pool.commit([0, 0])
    with pytest.raises(PoolStateError, match="duplicate"):
        pool.release([1, 1])
    # a rejected call changes nothing: both samples are still claimed exactly once
    p = pool.progress()
    assert (p.samples_claimed, p.samples_committed, p.samples_committed_total) == (2, 0, 0)
    assert [sid for sid, _ in pool.iter_available()] == [2]
    pool.commit([0])
    pool.release([1])
    p = pool.progress()
    assert (p.samples_claimed, p.samples_committed, len(pool)) == (0, 1, 2)


def test_empty_dataset_is_an_input_error():
    with pytest.raises(InputError, match="no samples"):
        SamplePool([])
    with pytest.raises(InputError):
        SamplePool([1], num_epochs=0)


ops = st.lists(st.tuples(st.sampled_from(["claim", "release", "commit", "checkpoint"]),
                         st.integers(1, 4)), max_size=300)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), min_size=1, max_size=25), ops=ops,
       epochs=st.integers(1, 3), seed=st.integers(0, 5))
def test_exactly_once_per_epoch(lengths, ops, epochs, seed):
    """Random claim/release/commit sequences, with crashes restored from checkpoints, commit each
    sample exactly once per epoch."""
    pool = SamplePool(lengths, num_epochs=epochs, seed=seed)
    committed: list[Counter] = [Counter() for _ in range(epochs)]
    claimed: list[int] = []
    saved = (pool.state_dict(), [c.copy() for c in committed])

    def drain(k):
        ids = [sid for sid, _ in pool.iter_available()][:k]
        pool.claim(ids)
        claimed.extend(ids)

    for op, k in ops:
        if op == "claim":
            drain(k)
        elif op == "release" and claimed:
            back, claimed[:] = claimed[:k], claimed[k:]
            pool.release(back)
        elif op == "commit" and claimed:
            done, claimed[:] = claimed[:k], claimed[k:]
            epoch = pool.epoch
            pool.commit(done)
            committed[epoch].update(done)
        elif op == "checkpoint":
            if k == 4:  # crash: everything since the last checkpoint is lost
                state, counts = saved
                pool = SamplePool(lengths, num_epochs=epochs, seed=seed)
                pool.load_state_dict(state)
                committed = [c.copy() for c in counts]
                claimed = []
            else:
                saved = (pool.state_dict(), [c.copy() for c in committed])
    # finish the run
    pool.release(claimed)
    while not pool.progress().finished:
        ids = [sid for sid, _ in pool.iter_available()]
        epoch = pool.epoch
        pool.claim(ids)
        pool.commit(ids)
        committed[epoch].update(ids)
    for c in committed:
        assert c == Counter(range(len(lengths)))
    p = pool.progress()
    assert p.samples_committed_total == epochs * len(lengths)
    assert p.tokens_committed_total == epochs * sum(lengths)


def test_claim_first_takes_the_iteration_prefix():
    pool = SamplePool([4, 1, 4, 2, 9, 4, 1], seed=3)
    order = [sid for sid, _ in pool.iter_available()]
    assert pool.claim_first(4) == order[:4]
    assert [sid for sid, _ in pool.iter_available()] == order[4:]
    assert pool.claim_first(10) == order[4:] and pool.is_empty
    assert pool.progress().samples_claimed == 7


@pytest.mark.parametrize("key,value", [
    ("committed", [0, 0]), ("committed", [5]), ("committed", "0"), ("epoch", -1),
    ("num_epochs", 0), ("seed", "x"), ("samples_committed_total", None), ("num_samples", 2.0)])
def test_a_damaged_saved_state_is_an_input_error(key, value):
    pool = SamplePool([1, 2, 3])
    pool.claim([0])
    pool.commit([0])
    state = {**pool.state_dict(), key: value}
    with pytest.raises(InputError) as e:
        SamplePool([1, 2, 3]).load_state_dict(state)
    assert e.value.field == f"pool.{key}"
    with pytest.raises(InputError):
        SamplePool.check_state([state])
    SamplePool.check_state(pool.state_dict())  # the undamaged one passes


@pytest.mark.parametrize("seed", [0, 3, 11])
def test_resumed_pool_gives_the_uninterrupted_order(seed):
    """A pool restored mid-epoch hands out the remaining samples in exactly the order the
    uninterrupted pool would: a resumed run forms the same batches (and so trains the same
    adapter). Oracle: the uninterrupted pool itself."""
    lengths = [5, 3, 5, 5, 3, 8, 5, 3, 3, 5, 8, 5]  # runs of equal lengths: the shuffle matters
    ref = SamplePool(lengths, num_epochs=2, seed=seed)
    first = ref.claim_first(4)
    ref.commit(first)
    state = ref.state_dict()
    rest = [sid for sid, _ in ref.iter_available()]
    resumed = SamplePool(lengths, num_epochs=2, seed=seed)
    resumed.load_state_dict(state)
    assert [sid for sid, _ in resumed.iter_available()] == rest
    # and the next epoch too
    for pool in (ref, resumed):
        pool.commit(pool.claim_first(len(rest)))
    assert [s for s, _ in resumed.iter_available()] == [s for s, _ in ref.iter_available()]
