"""The core loop's side of KV transfers (DESIGN.md "KV transfer": start_load / poll on the decode, start_send on
the prefill): pin the blocks a transfer touches, hand the copy to a lane worker (engine/kv_transfer/lanes.py),
and turn each result into the message its service waits for. The loop steps on meanwhile.

    decode   ImportKv ─▶ begin_import ─▶ start_load: pin the blocks to fill; lane = the prefill ─▶ KvIo.pull
             poll(): ended ─▶ unpin ─▶ ImportDone(ok | error)     (the request waits in IMPORTING throughout)
                     past its deadline ─▶ ImportDone(error) now; the blocks stay pinned until the copy ends
             Abort ─▶ forget: no ImportDone; the engine frees the request, the pin keeps the blocks until the end
    prefill  SendBlocks ─▶ start_send: pin the blocks; lane = the pair ─▶ KvIo.send ─▶ poll(): unpin ─▶ Reply

Core loop thread only. One thing crosses from a worker other than its result: a receive's NeedSend
(`send_now`, the pipe under the loop's send lock), so the prefill is asked when the receive is about to start.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from splitserve.engine import core_messages as m
from splitserve.engine.kv_transfer.io import Moved, PullTarget
from splitserve.engine.kv_transfer.lanes import Transfer, TransferLanes

log = logging.getLogger("splitserve.core")

# The transports give up by themselves after kv_transfer_timeout_s (engine/kv_transfer/io.py); this much later
# the loop reports a transfer failed whatever it is doing (a copy that never returns).
TIMEOUT_GRACE_S = 1.0
CLOSE_WAIT_S = 1.0  # at shutdown, how long running transfers get to end


class KvTransfers:
    """The transfers of one core: the engine (layout, pool, pins), its KvIo, `emit` (queue a message for the
    service's next batch) and `send_now` (send one at once, from any thread)."""

    def __init__(self, engine, kv_io, emit: Callable[[Any], None], send_now: Callable[[Any], None]) -> None:
        self.engine = engine
        self.kv_io = kv_io
        self.emit = emit
        self.send_now = send_now
        self.timeout_s = kv_io.timeout_s + TIMEOUT_GRACE_S  # a transfer's deadline, from its start
        self.lanes = TransferLanes()
        self.loads: dict[str, Transfer] = {}  # request_id -> its pull in flight, until reported

    @property
    def num_in_flight(self) -> int:
        return self.lanes.num_in_flight

    def poll(self) -> None:
        """Report every transfer that ended or passed its deadline (once per loop turn)."""
        self.lanes.poll()

    def close(self) -> int:
        return self.lanes.close(CLOSE_WAIT_S)

    # -- decode: pulls ---------------------------------------------------------------------
    def start_load(self, msg: m.ImportKv, dst_blocks: list[int], num_local: int) -> None:
        """Start pulling the blocks past the `num_local` cached here into `dst_blocks[num_local:]`."""
        spec, request_id = msg.spec, msg.request_id
        indices = list(range(num_local, len(spec.block_ids)))
        blocks = dst_blocks[num_local:]
        cached_tokens = num_local * self.engine.config.block_size
        start_ns = time.perf_counter_ns()
        try:
            if spec.layout != self.engine.layout:
                raise ValueError(self.engine.layout.mismatch(spec.layout))
            source = self.kv_io.prepare_pull(spec) if indices else None
        except Exception as exc:  # a failed pull fails this request only
            self._load_failed(request_id, spec.prefill_instance, cached_tokens, exc)
            return
        if not indices:  # every block cached here already
            self.emit(m.ImportDone(request_id, ok=True, num_cached_tokens=cached_tokens))
            return
        self.engine.pin_blocks(blocks)
        target = PullTarget(self.engine.runner.kv_cache, self.send_now, source)
        self.loads[request_id] = self.lanes.submit(
            spec.prefill_instance,
            functools.partial(self.kv_io.pull, spec, indices, blocks, target),
            functools.partial(self._load_done, request_id, spec.prefill_instance, blocks, cached_tokens, start_ns),
            functools.partial(self._load_timed_out, request_id, spec.prefill_instance, cached_tokens),
            self.timeout_s,
        )

    def forget(self, request_ids: list[str]) -> None:
        """Aborted requests: their pulls go on to the end (the blocks stay pinned) and report nothing."""
        for request_id in request_ids:
            self.loads.pop(request_id, None)

    def _load_done(self, request_id, prefill, blocks, cached_tokens, start_ns, transfer, moved: Moved, error) -> None:
        self.engine.unpin_blocks(blocks)  # the copy has ended: the blocks are the request's alone (if it lives)
        if self.loads.get(request_id) is not transfer:
            return  # aborted, or reported at its deadline
        del self.loads[request_id]
        if error is not None:
            self._load_failed(request_id, prefill, cached_tokens, error)
            return
        self.emit(
            m.ImportDone(
                request_id,
                ok=True,
                num_blocks_pulled=len(blocks),
                num_cached_tokens=cached_tokens,
                num_bytes=moved.num_bytes,
                transfer_ns=time.perf_counter_ns() - start_ns,
                device_ns=moved.device_ns,
            )
        )

    def _load_timed_out(self, request_id, prefill, cached_tokens, transfer) -> None:
        if self.loads.get(request_id) is not transfer:
            return
        del self.loads[request_id]
        error = TimeoutError(f"the copy did not end within {self.timeout_s:g} s (its blocks stay held until it does)")
        self._load_failed(request_id, prefill, cached_tokens, error)

    def _load_failed(self, request_id: str, prefill: str, cached_tokens: int, exc: BaseException) -> None:
        log.warning("request_id=%s KV pull failed: %s", request_id, exc)
        self.emit(
            m.ImportDone(
                request_id, ok=False, num_cached_tokens=cached_tokens, error=f"KV pull from {prefill} failed: {exc}"
            )
        )

    # -- prefill: sends --------------------------------------------------------------------
    def start_send(self, msg: m.SendBlocks) -> None:
        """Send a lease's blocks to the pair's decode; the blocks stay pinned until the send has ended, even if
        the lease is released or expires meanwhile."""
        try:
            self.engine.pin_blocks(msg.block_ids)
        except ValueError as exc:
            self.emit(m.Reply(msg.call_id, error=f"send to {msg.pair} failed: {exc}"))
            return
        kv_cache = self.engine.runner.kv_cache
        self.lanes.submit(
            msg.pair,
            functools.partial(self.kv_io.send, msg.pair, msg.block_ids, kv_cache, msg.tag),
            functools.partial(self._send_done, msg),
            functools.partial(self._send_timed_out, msg),
            self.timeout_s,
        )

    def _send_done(self, msg: m.SendBlocks, transfer: Transfer, value, error) -> None:
        self.engine.unpin_blocks(msg.block_ids)
        if transfer.timed_out:
            return  # answered at its deadline
        if error is not None:
            self.emit(m.Reply(msg.call_id, error=f"send to {msg.pair} failed: {error}"))
        else:
            self.emit(m.Reply(msg.call_id, value))

    def _send_timed_out(self, msg: m.SendBlocks, transfer: Transfer) -> None:
        self.emit(m.Reply(msg.call_id, error=f"send to {msg.pair} failed: it did not end within {self.timeout_s:g} s"))
