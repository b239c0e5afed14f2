"""Row layout of a forward (pure: runs without SGLang)."""

from __future__ import annotations

import random

from deltaserve.hosts.sglang.hooks import row_index


def test_rows_follow_batch_order_and_come_back_in_plan_order():
    # batch: client c1 (3 new tokens), sample s2 (4), decode d (1), sample s1 (2)
    got = row_index(["c1", "s2", "d", "s1"], [3, 4, 1, 2], ["s1", "s2"], [2, 4])
    assert got == [8, 9, 3, 4, 5, 6]


def test_a_sample_not_whole_or_missing_gives_no_rows():
    assert row_index(["s1"], [3], ["s1"], [4]) is None  # a prefix hit or a chunk
    assert row_index(["c1"], [3], ["s1"], [3]) is None


def test_against_brute_force_on_random_batches():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        ids = [f"r{i}" for i in range(n)]
        lens = [rng.randint(1, 9) for _ in ids]
        flat = [rid for rid, k in zip(ids, lens, strict=True) for _ in range(k)]
        chosen = rng.sample(ids, rng.randint(1, n))
        want = [i for rid in chosen for i, owner in enumerate(flat) if owner == rid]
        assert row_index(ids, lens, chosen, [lens[ids.index(r)] for r in chosen]) == want
