"""The engine core in a process of its own: its loop (the service's side is `client.EngineClient`).

    service process (gRPC, asyncio)            core process (model step loop)
    ───────────────────────────────            ──────────────────────────────
    EngineClient.send(msg) ─ batched ─pipe──▶  drain commands → poll transfers → step() → StepBatch
    per-request queues  ◀──── StepBatch ─────  (one message per step, all requests)
                                               KV pulls and sends: the transport's connector
                                               (engine/kv_connectors/base.py) runs them on worker
                                               threads; core_process/kv_scheduler.py, never in the loop

The loop never waits on gRPC or on a transfer: it blocks on the pipe only when it has nothing to step; a
transfer's worker wakes it when the transfer ends (`Wakeup`), so an idle decode reports a pull at once, and a pull
its lease's slot validates is committed in that turn (kv_scheduler.py) and stepped by the same turn's step.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing import connection

from splitserve.common.startup_heap import freeze_startup_heap
from splitserve.engine.core_process import messages as m
from splitserve.engine.core_process.gil import hand_gil_to_helpers
from splitserve.engine.core_process.kv_scheduler import KvScheduler, forks_outliving

log = logging.getLogger("splitserve.core")

HEARTBEAT_S = 0.5  # the most the core stays silent while it runs (Heartbeat), so a hung one can be told apart
TRANSFER_POLL_S = 0.001  # idle with grammars compiling: how often the loop looks for one that is done
# idle with transfers in flight: the most the loop waits (a worker wakes it at each end; this bounds only how late
# a transfer past its deadline is reported)
TRANSFER_WAIT_S = 0.05
MAX_BATCHES_PER_TURN = 256  # pipe messages taken in before one step (a bound, so a flood cannot hold off steps)


class CoreLoop:
    """Runs inside the core process: applies commands, steps the engine, reports."""

    def __init__(self, engine, conn, connector) -> None:
        self.engine = engine
        self.conn = conn
        self.connector = connector  # the transport's KvConnector: pairs and maps here; pulls and sends on workers
        # requests with a structured output spec, held back while their grammar compiles (engine/grammar_backend.py)
        self.compiling: list[tuple[m.AddRequest | m.ImportKv, Future]] = []
        self.outbox: list = []
        self._send_lock = threading.Lock()  # the pipe: this thread's flushes and a receive's NeedSend
        self.kv = KvScheduler(engine, connector, self._emit, self.send_now)
        self.background_replies: queue.SimpleQueue = queue.SimpleQueue()  # from pairing threads
        self.num_background = 0
        self.running = True
        self._last_sent = time.monotonic()  # when anything last went to the service (Heartbeat's clock)
        self._step_started: float | None = None  # while engine.step() runs: when it began (the beat thread's cue)
        self._stopped = threading.Event()
        self.wakeup = Wakeup()
        connector.lanes.notify = self.wakeup.set  # a transfer's end ends the loop's wait

    def run(self) -> None:
        threading.Thread(target=self._beat_in_steps, name="core-heartbeat", daemon=True).start()
        try:
            while self.running and self._turn():
                pass
        finally:
            self._stopped.set()
            # queued transfers are dropped; running ones get a moment to end
            if self.connector.close() == 0:  # no worker left to write to the wake pipe (a reused fd)
                self.wakeup.close()
            self.kv.close()

    def _turn(self) -> bool:
        """One loop turn; False when the service process is gone."""
        if self._wait(self._wait_s()):
            if not self._receive():
                return False  # the service process is gone
        elif os.getppid() == 1:
            return False  # orphaned
        self.engine.check_ranks()  # a tensor-parallel rank that exited ends the core, idle or not
        while not self.background_replies.empty():
            self.outbox.append(self.background_replies.get())
            self.num_background -= 1
        self.kv.poll()  # ended pulls (ImportDone) and sends (Reply); their blocks unpinned
        self._admit_compiled()
        self.kv.retry_imports()
        self.flush()  # replies and finished pulls (retried ones too) go out now, not after the step
        if self.engine.has_unfinished():
            self._step()
        self.outbox[:0] = self.kv.take_committed()  # imports committed this turn, before the step's outputs
        self.flush()
        if time.monotonic() - self._last_sent >= HEARTBEAT_S:
            self.send_now(m.Heartbeat())
        return True

    def _receive(self) -> bool:
        """Handle every batch the pipe holds (at least one is there), so the next step takes in all the requests
        that came during the last one: taking one batch a turn stepped a prefill's requests one at a time while
        more queued (a step of the default model on a CPU costs about the same for 1 request as for 10: it
        streams the weights). False when the pipe is closed."""
        for _ in range(MAX_BATCHES_PER_TURN):
            try:
                batch = self.conn.recv()
            except (EOFError, OSError):
                return False
            for msg in batch:
                self.handle(msg)
            if not self.running or not self.conn.poll(0):
                break
        return True

    def _wait_s(self) -> float:
        """How long to wait on the pipe: not at all with work to step; briefly while grammars compile or
        pairings run (they end on other threads); with transfers in flight until one ends (its worker wakes the
        wait); else until a message comes (imports waiting for room get it from one: a commit, an abort, a
        release)."""
        if self.engine.has_unfinished():
            return 0
        if self.compiling:
            return TRANSFER_POLL_S
        if self.num_background:
            return 0.01
        return TRANSFER_WAIT_S if self.kv.num_in_flight else 0.5

    def _wait(self, timeout_s: float) -> bool:
        """Whether the service's pipe holds a message, waited for up to `timeout_s`; with transfers in flight a
        transfer's end (on its worker) ends the wait too."""
        if not timeout_s or not self.kv.num_in_flight:
            return self.conn.poll(timeout_s)
        ready = connection.wait([self.conn, self.wakeup], timeout_s)
        self.wakeup.clear()  # before kv.poll(): a later end writes again, so none is missed
        return self.conn in ready

    def _emit(self, msg) -> None:
        self.outbox.append(msg)  # (flush replaces the list: a bound append would go stale)

    def send_now(self, msg) -> None:
        """Send one message at once, from any thread (a transfer worker's NeedSend)."""
        with self._send_lock:
            self.conn.send([msg])
            self._last_sent = time.monotonic()

    def flush(self) -> None:
        if self.outbox:
            with self._send_lock:
                self.conn.send(self.outbox)
                self._last_sent = time.monotonic()
            self.outbox = []

    def _beat_in_steps(self) -> None:
        """Keep the heartbeat going while one step runs long (a large prefill on a CPU takes seconds), saying how
        long it has run: the service must not take a busy core for a hung one and send its requests elsewhere.
        A stopped process, or a loop stuck outside a step, still goes silent; a step that never ends is left to
        the service's --core-stall-timeout-s."""
        while not self._stopped.wait(HEARTBEAT_S / 2):
            started = self._step_started
            if started is None or time.monotonic() - self._last_sent < HEARTBEAT_S:
                continue
            with self._send_lock:
                if self._step_started is started:  # not one that ended meanwhile (its outputs go out next)
                    self.conn.send([m.Heartbeat(in_step_s=time.monotonic() - started)])
                    self._last_sent = time.monotonic()

    def _step(self) -> None:
        start = time.perf_counter_ns()
        self._step_started = time.monotonic()
        try:
            outputs = self.engine.step()
        finally:
            self._step_started = None
        held = []
        for out in outputs:
            if out.finish_reason == "prefilled":
                blocks, hashes, num_tokens = self.engine.held_kv(out.request_id)
                held.append(m.HeldKv(out.request_id, blocks, hashes, num_tokens))
        self.outbox.append(
            m.StepBatch(
                outputs, held, self.engine.stats(), time.perf_counter_ns() - start, self.engine.last_step_num_tokens
            )
        )

    def handle(self, msg) -> None:
        handler = HANDLERS.get(type(msg))
        if handler is None:
            raise TypeError(f"core received unknown message {type(msg).__name__}")
        spec = getattr(msg.params, "structured_output", None) if isinstance(msg, (m.AddRequest, m.ImportKv)) else None
        if spec is not None:  # an imported request's spec was compiled within the budget on its prefill
            self.compiling.append((msg, self.engine.grammars.prepare(spec, vetted=isinstance(msg, m.ImportKv))))
            return  # admitted by _admit_compiled once its grammar is compiled
        handler(self, msg)

    def _admit_compiled(self) -> None:
        """Hand on the requests whose grammar is compiled: the engine finds it in xgrammar's cache (a spec that
        failed to compile fails again there, at once, and the request ends with its error)."""
        waiting, self.compiling = self.compiling, []
        for msg, future in waiting:
            if future.done():
                HANDLERS[type(msg)](self, msg)
            else:
                self.compiling.append((msg, future))

    # -- handlers --------------------------------------------------------------------------
    def on_add(self, msg: m.AddRequest) -> None:
        from splitserve.engine.outputs import RequestOutput

        try:
            self.engine.add_request(
                msg.request_id,
                msg.prompt_token_ids,
                msg.params,
                fork_ids=msg.fork_ids,
                priority=msg.priority,
                seed=msg.seed,
                share=msg.share,
            )
        except ValueError as exc:  # the request and its forks end here
            outs = [
                RequestOutput(rid, [], finished=True, finish_reason="error", error=str(exc))
                for rid in (msg.request_id, *self.kv.live_forks(msg))
            ]
            self.outbox.append(m.StepBatch(outs, stats=self.engine.stats()))
            return
        self.kv.admitted(msg.request_id)  # forks aborted while it compiled never run

    def on_abort(self, msg: m.Abort) -> None:
        from splitserve.engine.outputs import RequestOutput

        ids = set(msg.request_ids)
        # requests not in the engine yet (compiling; an import waiting for room) end here, with the forks aborted
        # with them; their other forks go on alone; a pull in flight runs to its end, its blocks pinned till then
        gone = self._abort_compiling(ids) | self.kv.abort(msg.request_ids)
        outs = [
            RequestOutput(rid, [], finished=True, finish_reason="abort")
            for rid in msg.request_ids
            if self.engine.abort(rid) or rid in gone
        ]
        self.outbox.append(m.StepBatch(outs, stats=self.engine.stats()))

    def _abort_compiling(self, ids: set[str]) -> set[str]:
        """Aborts among the requests waiting for their grammar: the ids that end here. The forks of an aborted
        one that are not aborted wait for the same grammar as requests of their own."""
        kept, gone, before = [], set(), self.compiling
        for msg, future in before:
            if msg.request_id in ids:
                gone |= self.kv.drop_pending(msg, ids)
                kept += [(fork, future) for fork in forks_outliving(msg, self.kv.live_forks(msg))]
            else:
                gone |= self.kv.note_aborted_forks(msg, ids)
                kept.append((msg, future))
        self.compiling = kept
        waited = {future for _, future in kept}
        for future in {future for _, future in before} - waited:
            self.engine.grammars.cancel(future)  # nobody waits for it now: its compile is stopped
        return gone

    def on_release(self, msg: m.ReleaseHeld) -> None:
        self.engine.release_kv(msg.request_id)
        self.outbox.append(m.StepBatch([], stats=self.engine.stats()))

    def on_import(self, msg: m.ImportKv) -> None:
        self.kv.add_import(msg)  # blocks now (or when there is room), the pull on a worker; the loop steps on

    def on_commit(self, msg: m.CommitImport) -> None:
        self.kv.commit(msg)

    def on_send(self, msg: m.SendBlocks) -> None:
        self.kv.start_send(msg)  # its Reply comes from a later loop turn, when the send has ended

    def on_pair(self, msg: m.Pair) -> None:
        """Join a communicator on a thread: the rendezvous waits for the peer, the step loop must not."""
        device = self.engine.runner.kv_cache.device

        def join() -> None:
            try:
                self.connector.pair(
                    msg.pair,
                    msg.rank,
                    msg.store_host,
                    msg.store_port,
                    msg.backend,
                    device,
                    local_host=msg.local_host or msg.store_host,
                )
                self.connector.keep_peer_awake(msg.peer_gpu_uuid)
                self.background_replies.put(m.Reply(msg.call_id, True))
            except Exception as exc:
                self.background_replies.put(m.Reply(msg.call_id, error=f"pairing {msg.pair} failed: {exc}"))

        self.num_background += 1
        threading.Thread(target=join, name=f"pair-{msg.pair}", daemon=True).start()

    def on_map_peer(self, msg: m.MapPeer) -> None:
        try:
            if msg.layout != self.engine.layout:
                self.connector.check_layout(msg.layout, self.engine.layout)  # raises unless a transfer plan maps them
                self.outbox.append(m.Reply(msg.call_id, True))  # pools of another TP size: mapped at the first pull
                return
            pool = self.connector.map_source(msg.prefill_instance, msg.transport, msg.endpoint, msg.layout)
            if pool is not None:  # a mapped pool (nixl maps none: it loaded the peer's agent and connected)
                import torch

                # one element copied now sets up the path a pull takes (peer access between the devices)
                kv_cache = self.engine.runner.kv_cache
                torch.empty(1, dtype=kv_cache.dtype, device=kv_cache.device).copy_(pool.view(-1)[:1])
                if kv_cache.is_cuda:
                    torch.cuda.synchronize(kv_cache.device)
            self.outbox.append(m.Reply(msg.call_id, True))
        except Exception as exc:
            self.outbox.append(m.Reply(msg.call_id, error=f"mapping {msg.prefill_instance}'s KV pool failed: {exc}"))

    def on_query(self, msg: m.Query) -> None:
        if msg.what == "stats":
            self.outbox.append(m.Reply(msg.call_id, self.engine.stats()))
        elif msg.what == "reset_prefix_cache":
            self.outbox.append(m.Reply(msg.call_id, self.engine.pool.reset_prefix_cache()))
        else:
            self.outbox.append(m.Reply(msg.call_id, error=f"unknown query {msg.what!r}"))

    def on_shutdown(self, msg: m.Shutdown) -> None:
        self.running = False


class Wakeup:
    """A self-pipe: a worker thread's `set` makes the loop's wait on it (`connection.wait`) return at once."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def fileno(self) -> int:
        return self._read

    def set(self) -> None:
        try:
            os.write(self._write, b"\0")
        except BlockingIOError:  # full: a wake is pending already
            pass

    def clear(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


HANDLERS: dict[type, Callable] = {
    m.AddRequest: CoreLoop.on_add,
    m.Abort: CoreLoop.on_abort,
    m.ReleaseHeld: CoreLoop.on_release,
    m.ImportKv: CoreLoop.on_import,
    m.CommitImport: CoreLoop.on_commit,
    m.SendBlocks: CoreLoop.on_send,
    m.Pair: CoreLoop.on_pair,
    m.MapPeer: CoreLoop.on_map_peer,
    m.Query: CoreLoop.on_query,
    m.Shutdown: CoreLoop.on_shutdown,
}


def core_main(config, conn, kv_options: dict, process_init: Callable[[], None] | None = None) -> None:
    """Entry point of the core process.

    It ignores SIGINT/SIGTERM: its service process decides when it stops (a Shutdown message
    after draining), and it exits by itself when that process is gone (the pipe closes).
    `process_init` (a module-level function, so it pickles) sets the process up first: the
    service passes its logging setup.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    hand_gil_to_helpers()  # a transfer's worker must not wait a whole 5 ms interval at each take
    if process_init is not None:
        process_init()
    connector = None
    try:
        from splitserve.engine.engine_core import EngineCore
        from splitserve.engine.kv_connectors.factory import make_connector

        connector = make_connector(kv_options)  # the transport, chosen once
        engine = EngineCore(
            config, kv_cache_factory=connector.kv_cache_factory, rank_pool_openers=connector.rank_pool_openers
        )
        conn.send([m.Ready(engine.info, engine.layout, connector.endpoint)])
        freeze_startup_heap()  # the model's and the imports' objects: a full collection would pause the steps
        CoreLoop(engine, conn, connector).run()
        engine.close()  # a tensor-parallel engine's ranks are told to stop (not left to find rank 0 gone)
    except Exception:
        try:
            conn.send([m.Fatal(traceback.format_exc())])
        except Exception:
            pass
        raise
    finally:
        if connector is not None:
            connector.close()
