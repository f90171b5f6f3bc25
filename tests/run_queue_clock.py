"""A clock that stands still while chosen threads wait for a CPU: timing what a process does, not
what the machine's other load does to it.

Linux accounts, per thread, the time it was runnable but not running: waiting in a run queue for a CPU
that other work held (the second field of /proc/self/task/<tid>/schedstat, in ns). On this 2-core
machine, shared with other jobs, those waits reach seconds (load 10-20), and a test that times a stream
or a /health answer in wall time then measures the machine, not the gateway.

`RunQueueClock(tids).now()` is wall time minus the run-queue waits of those threads so far, so an
interval read on it is the interval less the time those threads could not run for want of a CPU.
Everything the process itself does stays in it: CPU time spent in a callback, time a thread waits for
the GIL (a thread blocked on a lock sleeps; it is not runnable), time the loop waits for a slow peer.
Where the kernel keeps no schedstat (not Linux, or built without it) the clock is plain wall time.
"""

from __future__ import annotations

import os
import threading
import time


def run_queue_wait_s(tid: int) -> float | None:
    """Seconds thread `tid` of this process has waited in a run queue since it started; None when the
    kernel does not say."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class RunQueueClock:
    """Wall time (s) less the run-queue waits of the threads `tids` (native ids)."""

    def __init__(self, *tids: int) -> None:
        self.tids = tids
        self.available = all(run_queue_wait_s(t) is not None for t in tids) and os.name == "posix"

    @classmethod
    def of_this_thread_and(cls, *tids: int) -> RunQueueClock:
        """A clock over the calling thread and `tids`."""
        return cls(threading.get_native_id(), *tids)

    def now(self) -> float:
        if not self.available:
            return time.monotonic()
        return time.monotonic() - sum(run_queue_wait_s(t) or 0.0 for t in self.tids)
