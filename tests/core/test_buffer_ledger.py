import numpy as np
import pytest

from deltaserve.core import BufferLedger, InputError


def test_reserve_and_free_merge_runs():
    b = BufferLedger(100)
    spans = [b.reserve(i, 20) for i in range(5)]
    assert [s.start for s in spans] == [0, 20, 40, 60, 80]
    assert b.reserve(9, 1) is None and b.free_tokens == 0
    b.free(1)
    b.free(3)
    assert b.largest_free_run == 20 and b.free_tokens == 40
    b.free(2)
    assert b.largest_free_run == 60
    assert b.reserve(7, 55).start == 20


def test_random_operations_never_overlap():
    rng = np.random.default_rng(0)
    b = BufferLedger(512)
    held: dict[int, tuple[int, int]] = {}
    for sid in range(3000):
        if held and rng.random() < 0.5:
            victim = list(held)[rng.integers(len(held))]
            b.free(victim)
            del held[victim]
        else:
            n = int(rng.integers(1, 128))
            span = b.reserve(sid, n)
            if span is None:
                assert b.largest_free_run < n
                continue
            held[sid] = (span.start, span.stop)
        used = np.zeros(512, dtype=int)
        for lo, hi in held.values():
            used[lo:hi] += 1
        assert used.max() <= 1
        assert b.free_tokens == 512 - used.sum()


def test_errors():
    b = BufferLedger(10)
    b.reserve(1, 3)
    with pytest.raises(InputError):
        b.reserve(1, 3)
    with pytest.raises(InputError):
        b.free(2)
    with pytest.raises(InputError):
        BufferLedger(0)


def test_reserve_many_is_one_contiguous_run_or_nothing():
    ledger = BufferLedger(100)
    ledger.reserve(99, 10)  # rows 0..9
    assert ledger.reserve_many([1, 2, 3], [5, 20, 7]) == 10
    assert [ledger.span(i) for i in (1, 2, 3)] == [(10, 5), (15, 20), (35, 7)]
    assert ledger.reserve_many([4, 5], [40, 20]) is None  # 58 rows free, no run of 60
    assert not ledger.holds(4) and ledger.used_tokens == 42
    with pytest.raises(InputError):
        ledger.reserve_many([6, 2], [1, 1])  # 2 already holds rows
    with pytest.raises(InputError):
        ledger.reserve_many([7, 7], [1, 1])
    assert ledger.used_tokens == 42 and ledger.largest_free_run == 58  # a refusal reserves nothing
    ledger.free(2)
    assert ledger.largest_free_run == 58 and ledger.free_tokens == 78
