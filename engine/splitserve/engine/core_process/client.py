"""The service side of the engine core process: `EngineClient` starts it, batches commands into the pipe and
routes what comes back (each request's outputs to its queue, replies to their futures). The core's side is
`loop.CoreLoop`."""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from typing import Any

from splitserve.common.process_exit import exit_now
from splitserve.engine.core_process import messages as m
from splitserve.engine.core_process.gil import hand_gil_to_helpers
from splitserve.engine.core_process.loop import core_main

log = logging.getLogger("splitserve.core")

# How long a core whose pipe closed may take to exit before its death is reported without an exit code (a TP
# core closes its ranks first; on a loaded two-core machine that took over a second)
EXIT_WAIT_S = 10.0


def run_core_process(config, conn, kv_options: dict, process_init: Callable[[], None] | None) -> None:
    """The core process's target: `core_main`, then, once it returned, an exit without the interpreter's teardown
    (common/process_exit.py), so a service's shutdown does not wait seconds on it. A core that raised exits as
    multiprocessing makes it (its traceback, exit code 1)."""
    core_main(config, conn, kv_options, process_init)
    exit_now(0)


class EngineClient:
    """The service side: starts the core process, batches commands, routes outputs.

    Outputs arrive on a reader thread and are handed to the asyncio loop; each request's
    outputs go to its queue (`open_stream`), replies to their futures.
    """

    def __init__(
        self,
        config,
        kv_options: dict,
        on_batch: Callable[[Any], None] | None = None,
        process_init: Callable[[], None] | None = None,
        on_death: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.kv_options = kv_options
        self.on_batch = on_batch
        self.process_init = process_init  # run first in the core process (module-level: it is pickled)
        self.on_death = on_death  # called on the event loop, once, with why, when the core process is gone
        self.shutting_down = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.streams: dict[str, asyncio.Queue] = {}
        self.futures: dict[Any, asyncio.Future] = {}
        self.stats: dict[str, int] = {}
        self.info = self.layout = None
        self.endpoint: dict[str, str] = {}
        self._ids = itertools.count(1)
        self._outbox: list = []
        self._send_lock = threading.Lock()
        self._flush_scheduled = False
        self.dead = False
        self.fatal: str | None = None  # the last line of the core's Fatal report, when it sent one before exiting
        self.last_heard = time.monotonic()  # when the core last sent anything (set by the reader thread)
        self.step_began: float | None = None  # when the step the core's heartbeats say it is in began

    async def start(self, timeout_s: float = 600.0) -> None:
        self.loop = asyncio.get_running_loop()
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=run_core_process,
            args=(self.config, child, self.kv_options, self.process_init),
            name="splitserve-core",
            daemon=True,
        )
        self.process.start()
        child.close()
        ready = await asyncio.wait_for(self.loop.run_in_executor(None, self._conn.recv), timeout_s)
        first = ready[0]
        if isinstance(first, m.Fatal):
            raise RuntimeError(f"engine core failed to start:\n{first.message}")
        self.info, self.layout, self.endpoint = first.info, first.layout, first.endpoint
        self.last_heard = time.monotonic()
        self.start_reader()

    def start_reader(self) -> None:
        """Read the core's pipe on a thread of its own; the service's loop, busy with its streams, must not hold
        it a whole switch interval at each of its takes of the GIL (gil.py)."""
        hand_gil_to_helpers()
        threading.Thread(target=self._reader, name="core-reader", daemon=True).start()

    def _reader(self) -> None:
        while True:
            try:
                batch = self._conn.recv()
            except (EOFError, OSError):
                # the pipe closed: the process is exiting (closing its ranks first, under TP); wait for its exit code
                # here, off the event loop, as long as a loaded machine may take
                self.process.join(EXIT_WAIT_S)
                self._on_loop(self._core_died)
                return
            self.last_heard = time.monotonic()
            self._note_step(batch)
            self._on_loop(self._dispatch, batch)

    def _on_loop(self, fn, *args) -> None:
        """Run `fn` on the service's event loop, unless that loop has closed: the service is exiting (a port
        already taken, a shutdown) and nobody is left to tell."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            if not self.loop.is_closed():
                raise

    def _core_died(self) -> None:
        from splitserve.engine.outputs import RequestOutput

        if self.dead:
            return
        self.dead = True
        code = self.process.exitcode  # the reader waited for it
        why = f"engine core process exited (exit code {code})" if code is not None else "engine core process exited"
        if self.fatal:  # the error it raised (e.g. a tensor-parallel rank that exited), named for the clients
            why += f": {self.fatal}"
        for request_id, stream in list(self.streams.items()):
            stream.put_nowait(RequestOutput(request_id, [], finished=True, finish_reason="error", error=why))
        for future in self.futures.values():
            if not future.done():
                future.set_exception(RuntimeError(why))
        if self.on_death is not None and not self.shutting_down:
            self.on_death(why)

    def _dispatch(self, batch: list) -> None:
        for msg in batch:
            if isinstance(msg, m.StepBatch):
                self.stats = msg.stats or self.stats
                for out in msg.outputs:
                    queue = self.streams.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                if self.on_batch is not None:
                    self.on_batch(msg)
            elif isinstance(msg, m.Reply):
                future = self.futures.pop(msg.call_id, None)
                if future is not None and not future.done():
                    if msg.error:
                        future.set_exception(RuntimeError(msg.error))
                    else:
                        future.set_result(msg.value)
            elif isinstance(msg, (m.ImportDone, m.NeedSend)):
                if self.on_batch is not None:
                    self.on_batch(msg)
            elif isinstance(msg, m.Fatal):
                log.error("engine core failed:\n%s", msg.message)
                self.fatal = msg.message.strip().splitlines()[-1] if msg.message.strip() else None

    def _note_step(self, batch: list) -> None:
        """A step's outputs end it; a heartbeat from within a step says when that step began."""
        for msg in batch:
            if isinstance(msg, m.StepBatch):
                self.step_began = None
            elif isinstance(msg, m.Heartbeat):
                self.step_began = self.last_heard - msg.in_step_s if msg.in_step_s else None

    def silent_s(self) -> float:
        """Seconds since the core last sent anything: a running core sends at least every loop.HEARTBEAT_S,
        within a long step too."""
        return time.monotonic() - self.last_heard

    def in_step_s(self) -> float:
        """How long the step the core is in has run, by its heartbeats; 0 when none is known to run long."""
        began = self.step_began
        return 0.0 if began is None else time.monotonic() - began

    # -- sending ---------------------------------------------------------------------------
    def send(self, msg) -> None:
        """Queue a command; everything queued in one loop turn goes in one pipe message."""
        self._outbox.append(msg)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def flush(self) -> None:
        """Send what is queued now, not at the event loop's next turn (what the core waits for before it steps)."""
        self._flush()

    def _flush(self) -> None:
        self._flush_scheduled = False  # a flush still scheduled finds the outbox empty
        batch, self._outbox = self._outbox, []
        if batch and not self.dead:
            with self._send_lock:
                self._conn.send(batch)

    def open_stream(self, request_id: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = queue
        return queue

    def close_stream(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    async def call(self, make_msg: Callable[[int], Any], timeout_s: float = 30.0) -> Any:
        """Send a message that carries a call id and wait for its Reply."""
        call_id = next(self._ids)
        future = self.loop.create_future()
        self.futures[call_id] = future
        self.send(make_msg(call_id))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self.futures.pop(call_id, None)

    async def query(self, what: str) -> Any:
        return await self.call(lambda call_id: m.Query(call_id, what))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self.shutting_down = True  # the core's exit from here on is asked for, not a death
        if getattr(self, "process", None) is None:
            return
        try:
            with self._send_lock:
                self._conn.send([m.Shutdown()])
        except Exception:
            pass
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(2)
