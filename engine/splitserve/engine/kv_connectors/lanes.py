"""KV transfers off the core loop's thread: one worker thread per lane (a peer), results back through a queue.

    core loop thread                               lane worker thread (one per peer)
    ────────────────                               ─────────────────────────────────
    submit(lane, work, ...) ──▶ lane's queue ──▶   reports (transfer, started)
                                                   result = work()      tensors and the transport only
    poll(): on_done(transfer, result, error) ◀──   reports (transfer, result, error), then notify()
            on_timeout(transfer), once, when a started transfer runs past its deadline

Transfers of one lane run one after another, in the order they were submitted: NCCL matches a send to a
receive by order alone (no tags), so a pair's communicator carries one transfer at a time, as it did when
the loop itself waited. Every callback runs on the core loop's thread, inside `poll()`; a worker never
touches the engine. A transfer past its deadline is reported once (`on_timeout`) and still has its
`on_done` when its work ends, so whatever it holds (blocks it copies into) is let go only then.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("splitserve.kv")

_STARTED = object()  # a report's result slot when a worker starts a transfer


@dataclass(eq=False)
class Transfer:
    """One pull or send. The core loop owns it; its worker only runs `work` and reports."""

    lane: str
    work: Callable[[], Any]  # runs on the lane's worker thread
    on_done: Callable[[Transfer, Any, BaseException | None], None]  # core loop thread
    on_timeout: Callable[[Transfer], None]  # core loop thread; once at most, before on_done
    timeout_s: float  # from the moment its worker starts it
    deadline: float | None = None  # time.monotonic() s; set when its worker reports it started
    timed_out: bool = False


class TransferLanes:
    """Worker threads (daemons, one per lane, started on first use) and the one queue they report on."""

    def __init__(self) -> None:
        self._lanes: dict[str, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []
        self._reports: queue.SimpleQueue = queue.SimpleQueue()
        self._started: set[Transfer] = set()  # started, not yet done
        self.num_in_flight = 0  # submitted, not yet done (queued in a lane or running)
        # called on the worker after each result is queued: an idle core loop waits for it, not for a poll
        self.notify: Callable[[], None] | None = None

    def submit(
        self,
        lane: str,
        work: Callable[[], Any],
        on_done: Callable[[Transfer, Any, BaseException | None], None],
        on_timeout: Callable[[Transfer], None],
        timeout_s: float,
    ) -> Transfer:
        transfer = Transfer(lane, work, on_done, on_timeout, timeout_s)
        jobs = self._lanes.get(lane)
        if jobs is None:
            jobs = self._lanes[lane] = queue.SimpleQueue()
            thread = threading.Thread(target=self._run_lane, args=(jobs,), name=f"kv-{lane}", daemon=True)
            self._threads.append(thread)
            thread.start()
        self.num_in_flight += 1
        jobs.put(transfer)
        return transfer

    def _run_lane(self, jobs: queue.SimpleQueue) -> None:
        while (transfer := jobs.get()) is not None:
            self._reports.put((transfer, _STARTED, None))
            try:
                result, error = transfer.work(), None
            except BaseException as exc:  # reported, never lost: the loop decides what a failure means
                result, error = None, exc
            self._reports.put((transfer, result, error))
            if self.notify is not None:
                self.notify()

    def poll(self) -> None:
        """Run the callbacks of every report so far, then of every deadline passed (core loop thread)."""
        while True:
            try:
                transfer, result, error = self._reports.get_nowait()
            except queue.Empty:
                break
            if result is _STARTED:
                transfer.deadline = time.monotonic() + transfer.timeout_s
                self._started.add(transfer)
                continue
            self._started.discard(transfer)
            self.num_in_flight -= 1
            transfer.on_done(transfer, result, error)
        now = time.monotonic()
        for transfer in [t for t in self._started if not t.timed_out and now > t.deadline]:
            transfer.timed_out = True
            transfer.on_timeout(transfer)

    def close(self, wait_s: float) -> int:
        """Drop the transfers still queued, stop the workers, and wait up to `wait_s` for the running ones.
        Returns how many still run then (daemon threads: they end with the process)."""
        for jobs in self._lanes.values():
            try:
                while True:
                    jobs.get_nowait()
            except queue.Empty:
                jobs.put(None)
        deadline = time.monotonic() + wait_s
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        alive = sum(thread.is_alive() for thread in self._threads)
        if alive:
            log.warning("%d KV transfer worker(s) still running at exit", alive)
        return alive
