"""The bench's frozen heap: what exists before the block is frozen for it and only for it, and
garbage made inside the block is still collected."""

import gc
import weakref

from deltaserve.bench.gc_heap import frozen_heap


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def tracked(obj) -> bool:
    """Whether a collection would walk ``obj`` (frozen objects are in no generation)."""
    return any(o is obj for o in gc.get_objects())


def test_objects_before_the_block_are_frozen_during_it_and_only_during_it():
    kept = Node()
    assert tracked(kept)
    with frozen_heap() as heap:
        assert heap.num_frozen > 0 and not tracked(kept)
        assert heap.full_collect_s >= 0 and heap.frozen_collect_s >= 0
        made = Node()
        assert tracked(made)  # made after the freeze: collected as usual
    assert tracked(kept) and gc.get_freeze_count() == 0


def test_a_cycle_dropped_before_the_block_is_freed_by_its_first_collection():
    ref = weakref.ref(Node())  # unreachable garbage in a cycle
    with frozen_heap():
        assert ref() is None  # collected, not frozen forever


def test_garbage_made_inside_the_block_is_still_collected():
    with frozen_heap():
        ref = weakref.ref(Node())
        gc.collect()
        assert ref() is None


def test_the_heap_is_unfrozen_when_the_block_raises():
    try:
        with frozen_heap():
            raise RuntimeError("replay failed")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0
