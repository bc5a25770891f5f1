"""Freezing the start-up heap: live objects leave the collector's walks, garbage does not stay."""

from __future__ import annotations

import gc
import weakref

from wire.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_live_start_up_objects_are_frozen_and_start_up_garbage_is_collected_first() -> None:
    kept = _Node()
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle only the collector frees
    garbage = weakref.ref(a)
    del a, b
    try:
        frozen = freeze_startup_heap()
        # Frozen objects that other threads (earlier tests') free meanwhile leave the count.
        assert 0 < gc.get_freeze_count() <= frozen
        assert garbage() is None  # collected before the freeze, not kept forever
        tracked = {id(o) for o in gc.get_objects()}
        assert id(kept) not in tracked  # a full collection no longer walks it
        later = _Node()
        assert id(later) in {id(o) for o in gc.get_objects()}
    finally:
        gc.unfreeze()
    assert id(kept) in {id(o) for o in gc.get_objects()}
