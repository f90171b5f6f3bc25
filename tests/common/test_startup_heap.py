"""freeze_startup_heap: garbage alive in cycles is collected first; every object still alive leaves the
collector's generations, so later full collections skip it."""

import gc
import weakref

from splitserve.common.startup_heap import freeze_startup_heap


class Node:
    pass


def test_cyclic_garbage_is_collected_and_what_lives_is_frozen():
    garbage = Node()
    garbage.loop = garbage  # freed only by a collection
    gone = weakref.ref(garbage)
    del garbage
    alive = Node()
    alive.loop = alive
    try:
        frozen = freeze_startup_heap()
        assert gone() is None, "cyclic garbage was frozen instead of collected"
        assert frozen == gc.get_freeze_count() > 0
        assert not any(obj is alive for obj in gc.get_objects()), "a live object is still in a generation"
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
    assert any(obj is alive for obj in gc.get_objects())
