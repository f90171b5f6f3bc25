"""The scheduler side of KV transfer inside a core (docs/kv-connector.md): which blocks a load fills, imports
waiting for room, the blocks a transfer pins, and when a request whose KV was pulled may run. It drives the
transport's connector (kv_connectors/base.py) through `start_load` / `start_send` / `poll` only, and
turns what the connector reports into the messages its service waits for. The loop steps on meanwhile.

    decode   ImportKv ─▶ begin_import (blocks; the prefix cached here is not pulled)   no room: again after a free
                        ─▶ start_load: pin the blocks to fill        request: WAITING_FOR_KV
             poll(): ended ─▶ unpin ─▶ the lease's slot read (shm, cuda_ipc: kv_connectors/lease_slots.py)
                       held ─▶ finish_import now (this loop turn steps it) ─▶ ImportDone(committed), sent
                               after that step, ahead of its outputs (take_committed)
                       lost ─▶ ImportDone(lease_lost)      no slot to read, or nccl / nixl ─▶ ImportDone(ok)
                     failed, or past its deadline ─▶ ImportDone(error) now; the blocks stay pinned until it ends
             CommitImport(ok)  ─▶ finish_import: the request joins the running batch (the service validated the
                                  lease after the copy: SendKv's or ReleaseKv's answer)
             CommitImport(not ok) ─▶ fail_import: recompute locally, or end with an error (kv_load_failure_policy)
             Abort ─▶ forget: no ImportDone; the engine frees the request, the pin keeps the blocks until the end
    prefill  SendBlocks ─▶ start_send: pin the blocks ─▶ poll(): ended ─▶ unpin ─▶ Reply

Forks (n > 1, scheduling/parallel_sampling.py): an import's `fork_ids` fork from its pulled KV when it commits;
under policy fail they end with it. A request not in the engine yet (waiting for room here, or for its grammar in
the core loop) is a message: aborting it ends it here, and its forks not aborted with it go on as requests of their
own (local prefill, seeded as they would have been); a fork aborted on its own is noted (`aborted_forks`) and
dropped when its request reaches the engine, so it never runs.

Core loop thread only. One thing crosses from a worker other than its result: a receive's SendWanted, sent as
NeedSend (`send_now`, the pipe under the loop's send lock), so the prefill is asked when the receive is about to
start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from splitserve.engine.core_process import messages as m
from splitserve.engine.kv_connectors.base import Completion, KvConnector, Load, Send, SendWanted
from splitserve.engine.kv_connectors.factory import MAPPED_TRANSPORTS
from splitserve.engine.kv_connectors.lease_slots import LeaseSlotReader

log = logging.getLogger("splitserve.core")


class KvScheduler:
    """The KV transfers of one core: the engine (layout, pool, pins, import states), its connector, `emit`
    (queue a message for the service's next batch) and `send_now` (send one at once, from any thread)."""

    def __init__(self, engine, connector: KvConnector, emit: Callable[[Any], None], send_now: Callable[[Any], None]):
        self.engine = engine
        self.connector = connector
        self.emit = emit
        self.send_now = send_now
        self.waiting_for_room: list[m.ImportKv] = []  # imports the pool cannot hold yet (retry_imports)
        self._tried_at: dict[str, int] = {}  # waiting import -> the pool's num_blocks_freed when last tried
        self.aborted_forks: dict[str, set[str]] = {}  # request not in the engine yet -> its forks aborted already
        self.lease_slots = LeaseSlotReader()  # the prefills' lease tables (shm, cuda_ipc), mapped on first use
        self._committed: list = []  # messages of the imports committed here this turn (take_committed)

    @property
    def num_in_flight(self) -> int:
        return self.connector.num_in_flight

    def poll(self) -> None:
        """Once per loop turn: unpin the blocks of every transfer that ended; report each transfer once. When an
        end frees blocks (an aborted pull's, a send's after its lease ended), the service gets fresh stats at once:
        no step may come to carry them, and its Describe (what routers read) would show the blocks held."""
        num_free = self.engine.num_free_blocks
        for done in self.connector.poll():
            if done.ended:  # the copy is over: the blocks are their request's alone (if it lives)
                self.engine.unpin_blocks(done.transfer.block_ids)
            if done.report:
                (self._report_load if isinstance(done.transfer, Load) else self._report_send)(done)
        if self.engine.num_free_blocks != num_free:
            self.emit(m.StepBatch([], stats=self.engine.stats()))

    # -- decode: imports ----------------------------------------------------------------------
    def add_import(self, msg: m.ImportKv) -> None:
        """Allocate the prompt's blocks and start pulling; without room now, wait (retry_imports). An import of a
        lower or equal share waiting already goes first: this one waits behind it."""
        if any(waiting.share <= msg.share for waiting in self.waiting_for_room):
            self._tried_at[msg.request_id] = -1  # never tried: tried at the next retry
            self.waiting_for_room.append(msg)
            return
        if not self._try_import(msg):
            self._hold_room()

    def _try_import(self, msg: m.ImportKv) -> bool:
        """Begin `msg`'s import; False when the pool cannot hold it now (it then waits for room)."""
        try:
            started = self.engine.begin_import(
                msg.request_id,
                msg.prompt_token_ids,
                msg.params,
                msg.seed,
                msg.first_token_id,
                msg.first_logprobs,
                msg.priority,
                msg.fork_ids,
                share=msg.share,
            )
        except ValueError as exc:  # a bad request, not a failed pull: it ends here, and its forks
            self._end(msg.request_id, str(exc), self.live_forks(msg))
            return True
        if started is None:
            self.waiting_for_room.append(msg)
            self._tried_at[msg.request_id] = self.engine.pool.num_blocks_freed
            return False
        self.admitted(msg.request_id)
        self._start_load(msg, *started)  # the request waits in WAITING_FOR_KV; the loop steps on
        return True

    def retry_imports(self) -> None:
        """Once per loop turn: try the imports waiting for room again, lower shares first (then arrival), up to
        the first that still does not fit (the blocks freed are held for it, not handed to a larger share), if a
        block was freed since its last try (each try hashes the prompt and looks it up: ~0.2 ms per 2,048 tokens,
        per waiting import, per turn). A prefix cached meanwhile could also make room; it waits for the next free,
        which every request's end brings."""
        if not self.waiting_for_room:
            return
        freed = self.engine.pool.num_blocks_freed
        waiting = sorted(self.waiting_for_room, key=_share)
        if self._tried_at.get(waiting[0].request_id) == freed:
            return  # tried since the last free: it would fail again
        self.waiting_for_room = []
        for i, msg in enumerate(waiting):
            if not self._try_import(msg):
                self.waiting_for_room.extend(waiting[i + 1 :])
                break
        self._tried_at = {msg.request_id: self._tried_at[msg.request_id] for msg in self.waiting_for_room}
        self._hold_room()

    def _hold_room(self) -> None:
        """The first import waiting for room holds it against larger shares: the scheduler admits none of them
        meanwhile and preempts running ones (largest share first) until the blocks it needs are free."""
        scheduler = self.engine.scheduler
        if not self.waiting_for_room:
            scheduler.import_share = None
            return
        head = min(self.waiting_for_room, key=_share)
        scheduler.import_share = head.share
        scheduler.make_room(self.engine.import_blocks_needed(head.prompt_token_ids), head.share)

    def _start_load(self, msg: m.ImportKv, dst_blocks: list[int], num_local: int) -> None:
        """Pull the handle's blocks past the `num_local` cached here into `dst_blocks[num_local:]`."""
        spec, request_id = msg.spec, msg.request_id
        cached_tokens = num_local * self.engine.config.block_size
        indices = list(range(num_local, len(spec.block_ids)))
        load = Load(request_id, spec, indices, dst_blocks[num_local:], self.engine.runner.kv_cache, self._ask_send)
        try:
            self.connector.check_layout(spec.layout, self.engine.layout)
            if indices:
                self.connector.start_load(load)
        except Exception as exc:  # a pull that cannot start fails this request only
            self._load_failed(request_id, spec.prefill_instance, cached_tokens, exc)
            return
        if not indices:  # every block cached here already: nothing of the prefill's is read, no lease to check
            self._commit_here(m.ImportDone(request_id, ok=True, num_cached_tokens=cached_tokens, committed=True))
            return
        self.engine.pin_blocks(load.block_ids)  # before this thread can free them; the copy holds them

    def _ask_send(self, wanted: SendWanted) -> None:
        """A receive's request for the prefill's send (on its transfer worker), passed to the service at once."""
        self.send_now(m.NeedSend(wanted.request_id, wanted.pair, wanted.block_indices))

    def _report_load(self, done: Completion) -> None:
        load: Load = done.transfer
        cached_tokens = load.indices[0] * self.engine.config.block_size
        if done.error is not None:
            self._load_failed(load.request_id, load.spec.prefill_instance, cached_tokens, done.error)
            return
        held = self.lease_held(load.spec)  # the copy is over (reported by its worker, a device copy synchronized)
        report = m.ImportDone(
            load.request_id,
            ok=True,
            num_blocks_pulled=len(load.block_ids),
            num_cached_tokens=cached_tokens,
            num_bytes=done.result.num_bytes,
            transfer_ns=time.perf_counter_ns() - load.start_ns,
            device_ns=done.result.device_ns,
            committed=held is True,
            lease_lost=held is False,
            ended_unix_ns=time.time_ns(),
        )
        if held:  # no round trip to the service for the verdict: this turn's step runs the request
            self._commit_here(report)
        else:
            self.emit(report)

    def lease_held(self, spec: m.PullSpec) -> bool | None:
        """Whether the lease of an ended copy out of the prefill's pool still holds, read from its slot now: True /
        False, or None when no slot says (nccl and nixl, a handle without a slot, a table that cannot be read or
        whose owner stopped beating): the service decides. Called only after the copy has ended."""
        if spec.lease is None or spec.transport not in MAPPED_TRANSPORTS:
            return None
        return self.lease_slots.check(spec.prefill_instance, spec.lease)

    def _load_failed(self, request_id: str, prefill: str, cached_tokens: int, exc: BaseException) -> None:
        log.warning("request_id=%s KV pull failed: %s", request_id, exc)
        self.emit(
            m.ImportDone(
                request_id, ok=False, num_cached_tokens=cached_tokens, error=f"KV pull from {prefill} failed: {exc}"
            )
        )

    def commit(self, msg: m.CommitImport) -> None:
        """The service's verdict after the copy: run the request (ok: the lease held), or the failure policy."""
        if msg.request_id not in self.engine.waiting_for_kv:
            return  # aborted meanwhile (or committed here already)
        if msg.ok:
            self._run_imported(msg.request_id)
            return
        forks = self.engine.fail_import(msg.request_id, recompute=msg.recompute)
        if not msg.recompute:
            self._end(msg.request_id, msg.error or "KV lease was no longer valid after the copy", forks)

    def _run_imported(self, request_id: str, emit: Callable[[Any], None] | None = None) -> None:
        """The prompt's KV is in place and valid: the request joins the running batch (its forks fork)."""
        done = self.engine.finish_import(request_id)
        if done is not None:  # the first token already ended it
            (emit or self.emit)(m.StepBatch([done], stats=self.engine.stats()))

    def _commit_here(self, report: m.ImportDone) -> None:
        """Commit an import without the service: it runs in this loop turn's step. The service hears of it with that
        step's outputs (`take_committed`), not before the step: a message sent then wakes the service, whose work
        would share the machine with the step (on a 2-core CPU it delayed the step's start by 0.3-0.9 ms)."""
        self._committed.append(report)
        self._run_imported(report.request_id, self._committed.append)

    def take_committed(self) -> list:
        """The ImportDone of each import committed here since the last call (and the output of one its first token
        ended), in order: the loop sends them after its step, before the step's outputs."""
        committed, self._committed = self._committed, []
        return committed

    def close(self) -> None:
        self.lease_slots.close()

    def abort(self, request_ids: list[str]) -> set[str]:
        """Aborted requests: no longer waiting for room (the forks of one that was outlive it: each computes the
        prompt itself, scheduling/parallel_sampling.py); a fork aborted while its request waits for room is noted,
        never created; a pull in flight runs to its end (blocks pinned till then) and reports nothing. The engine
        frees the requests it has. Returns the ids that ended here: the engine never had them."""
        ids = set(request_ids)
        ended: set[str] = set()
        waiting = []
        for pull in self.waiting_for_room:
            if pull.request_id in ids:
                ended |= self.drop_pending(pull, ids)
                for fork in forks_outliving(pull, self.live_forks(pull)):
                    self.engine.add_request(
                        fork.request_id,
                        fork.prompt_token_ids,
                        fork.params,
                        priority=fork.priority,
                        seed=fork.seed,
                        share=fork.share,
                    )
            else:
                ended |= self.note_aborted_forks(pull, ids)
                waiting.append(pull)
        self.waiting_for_room = waiting
        self.engine.scheduler.import_share = min((pull.share for pull in waiting), default=None)
        for request_id in request_ids:
            self.connector.forget(request_id)
        return ended

    # -- forks of requests not in the engine yet (waiting for room here; compiling in the core loop) ------------
    def note_aborted_forks(self, msg: m.AddRequest | m.ImportKv, ids: set[str]) -> set[str]:
        """Note the forks of `msg` (not in the engine yet) that `ids` aborts; they end now. Returns them."""
        aborted = ids.intersection(msg.fork_ids)
        if aborted:
            self.aborted_forks.setdefault(msg.request_id, set()).update(aborted)
        return aborted

    def drop_pending(self, msg: m.AddRequest | m.ImportKv, ids: set[str]) -> set[str]:
        """`msg` (not in the engine yet) is aborted: it and the forks `ids` aborts with it end now. Returns them;
        `live_forks(msg)` then gives the forks that go on."""
        return {msg.request_id} | self.note_aborted_forks(msg, ids)

    def live_forks(self, msg: m.AddRequest | m.ImportKv) -> list[str]:
        """The forks of `msg` not aborted (and forgets the aborted ones): those that end with it, or go on."""
        aborted = self.aborted_forks.pop(msg.request_id, set())
        return [f for f in msg.fork_ids if f not in aborted]

    def admitted(self, request_id: str) -> None:
        """`request_id` reached the engine: its forks aborted before it did go (they never run)."""
        for fork_id in sorted(self.aborted_forks.pop(request_id, ())):
            self.engine.abort(fork_id)

    def _end(self, request_id: str, error: str, fork_ids=()) -> None:
        """End a request the engine does not hold (and its forks) with `error`."""
        from splitserve.engine.outputs import RequestOutput

        outs = [
            RequestOutput(rid, [], finished=True, finish_reason="error", error=error) for rid in (request_id, *fork_ids)
        ]
        self.emit(m.StepBatch(outs, stats=self.engine.stats()))

    # -- prefill: sends -----------------------------------------------------------------------
    def start_send(self, msg: m.SendBlocks) -> None:
        """Send a lease's blocks to the pair's decode; they stay pinned until the send has ended, even if the
        lease is released or expires meanwhile."""
        try:
            self.engine.pin_blocks(msg.block_ids)
        except ValueError as exc:
            self.emit(m.Reply(msg.call_id, error=f"send to {msg.pair} failed: {exc}"))
            return
        send = Send(msg.call_id, msg.pair, msg.block_ids, self.engine.runner.kv_cache, msg.tag)
        try:
            self.connector.start_send(send)
        except Exception as exc:
            self.engine.unpin_blocks(msg.block_ids)
            self.emit(m.Reply(msg.call_id, error=f"send to {msg.pair} failed: {exc}"))

    def _report_send(self, done: Completion) -> None:
        send: Send = done.transfer
        if done.error is not None:
            self.emit(m.Reply(send.call_id, error=f"send to {send.pair} failed: {done.error}"))
        else:
            self.emit(m.Reply(send.call_id, done.result))


def forks_outliving(msg: m.AddRequest | m.ImportKv, fork_ids: list[str]) -> list[m.AddRequest]:
    """The forks `fork_ids` of `msg`, aborted before it reached the engine, as requests of their own: each computes
    the prompt itself, seeded as its fork would have been (the request's seed + its index in `msg.fork_ids`)."""
    base = msg.seed if msg.seed is not None else msg.params.seed
    index = {fork_id: i for i, fork_id in enumerate(msg.fork_ids, start=1)}
    return [
        m.AddRequest(
            fork_id,
            msg.prompt_token_ids,
            msg.params,
            msg.priority,
            base + index[fork_id] if base is not None else None,
            share=msg.share,
        )
        for fork_id in fork_ids
    ]


def _share(msg: m.ImportKv) -> int:
    return msg.share
