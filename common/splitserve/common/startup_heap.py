"""The collector's view of a server process's start-up heap.

A full (oldest-generation) collection scans every tracked object, and a server's start-up leaves hundreds of
thousands of them that live as long as it does: the gateway's imports and tokenizer are 326k, and one full
collection of them took 197-305 ms on a 2-core Xeon. Such a collection runs whenever enough objects have outlived
the younger generations, and it holds the event loop (every stream waits) or the core's step loop meanwhile.
Frozen, they are out of every later collection, which then scans only what serving allocated (0.0 ms for the
gateway's frozen heap). vLLM's API server does the same after start-up.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now to the collector's permanent generation (call it in a
    process's entry path once it is ready to serve, never in a library call). Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
