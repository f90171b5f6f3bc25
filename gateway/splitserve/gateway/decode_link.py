"""The gateway's one long-lived `Decode.Generate` stream to one decode instance.

All of the gateway's requests on that instance share the stream: requests and aborts go
out through one writer task (grpc.aio allows one write at a time), and one reader task
routes every `DecodeOut.deltas[i]` to its request's asyncio.Queue by request_id.

    reserve(id) ─┐                                           SEAT_GRANTED ┐
    submit(req) ──▶ outbox ──writer──▶ Decode.Generate ──reader──▶ queues[request_id]
                      ▲                                      │ each DecodeOut read: OutputsRead(count)
                      └──────────────────────────────────────┘ (the decode paces the stream by it)

When the stream breaks (the instance died, closed the stream, or the registry gave up on
it), every request still on it receives one `LinkFailure` naming the instance, and the
link is dead for good: the registry opens a new one when Describe answers again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from splitserve.protos import decode_pb2, decode_pb2_grpc

log = logging.getLogger("splitserve.gateway")
# In the outbox: tell the decode how many messages were read (OutputsRead). The decode keeps at most a few unread
# and merges later steps into the next one, so a busy gateway gets more tokens a message, never a queue of old
# steps (decode_service/stream_pacing.py).
_READ_REPORT = object()
# Put on a request's queue when the decode granted the seats it reserved (DecodeOut.seats_granted).
SEAT_GRANTED = object()
# Put on a request's queue by the request's own timer at its deadline (request_seat.deadline_timer).
DEADLINE = object()


@dataclass(frozen=True)
class LinkFailure:
    """Put on a request's queue when its decode stream broke; `message` is client-facing."""

    message: str


class LinkDown(RuntimeError):
    """submit() on a link that is not (or no longer) open."""


class DecodeLink:
    """One bidirectional stream to one decode instance, multiplexing many requests.

    Invariants: a request id is in `_queues` from reserve() or submit() until its final delta was
    routed (`finish`), it was aborted (`abort`), or the link failed; each queue receives at most one
    SEAT_GRANTED (reserved ids, before submit), TokenDeltas in stream order and at most one LinkFailure,
    after which nothing else (the request's own deadline timer may add DEADLINE at any point).
    """

    def __init__(
        self, name: str, channel: grpc.aio.Channel, on_broken: Callable[[DecodeLink, str], None] | None = None
    ) -> None:
        self.name = name  # the instance id, used in client-facing error messages
        self._stub = decode_pb2_grpc.DecodeStub(channel)
        self._on_broken = on_broken
        self._queues: dict[str, asyncio.Queue] = {}
        self._reserved: set[str] = set()  # ids whose seat reservation was sent and that were not submitted yet
        self._outbox: asyncio.Queue[decode_pb2.DecodeIn | object | None] = asyncio.Queue()
        self._num_read = 0  # DecodeOut messages routed; reported to the decode, which paces the stream by it
        self._read_report_queued = False
        self._call: grpc.aio.StreamStreamCall | None = None
        self._tasks: list[asyncio.Task] = []
        self.alive = False
        self.error = ""

    def open(self) -> None:
        """Start the stream and its reader and writer tasks (no round trip is awaited)."""
        self._call = self._stub.Generate()
        self.alive = True
        self._tasks = [
            asyncio.create_task(self._write(), name=f"decode-link-writer-{self.name}"),
            asyncio.create_task(self._read(), name=f"decode-link-reader-{self.name}"),
        ]

    @property
    def num_requests(self) -> int:
        """Requests of this gateway currently on the stream."""
        return len(self._queues)

    def reserve(self, request_id: str, num_seqs: int, hold_s: float, share: int = 0) -> asyncio.Queue:
        """Ask the decode for `num_seqs` seats for `request_id` (decode_service/seats.py); return the queue that
        gets SEAT_GRANTED when it grants them (or an error TokenDelta, a LinkFailure), and later, once submitted
        under the same id, the request's deltas. `abort` drops the reservation. `share`: the caller's fair share
        (the decode grants lower shares first)."""
        if not self.alive:
            raise LinkDown(f"decode instance {self.name} is not connected: {self.error or 'stream not open'}")
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already running on decode {self.name}")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._reserved.add(request_id)
        hold_ms = min(max(1, round(hold_s * 1000)), 2**32 - 1)
        seat = decode_pb2.SeatRequest(request_id=request_id, num_seqs=num_seqs, hold_ms=hold_ms, share=share)
        self._outbox.put_nowait(decode_pb2.DecodeIn(reserve=seat))
        return queue

    def submit(self, request: decode_pb2.DecodeRequest) -> asyncio.Queue:
        """Send a request (claiming the seats reserved under its id, if any); return the queue its TokenDeltas
        (then maybe a LinkFailure) arrive on (those of its fork ids: `follow`)."""
        if not self.alive:
            raise LinkDown(f"decode instance {self.name} is not connected: {self.error or 'stream not open'}")
        reserved = request.request_id in self._reserved
        if request.request_id in self._queues and not reserved:
            raise ValueError(f"request_id {request.request_id!r} is already running on decode {self.name}")
        if any(fork_id in self._queues for fork_id in request.fork_ids):
            raise ValueError(f"a fork id of {request.request_id!r} is already running on decode {self.name}")
        self._reserved.discard(request.request_id)
        queue: asyncio.Queue = self._queues[request.request_id] if reserved else asyncio.Queue()
        self._queues[request.request_id] = queue
        for fork_id in request.fork_ids:  # the request's other sequences: their deltas wait for follow()
            self._queues[fork_id] = asyncio.Queue()
        self._outbox.put_nowait(decode_pb2.DecodeIn(request=request))
        return queue

    def follow(self, fork_id: str) -> asyncio.Queue:
        """The queue of a fork id submitted with its request (its deltas since then, or a LinkFailure)."""
        queue = self._queues.get(fork_id)
        if queue is None:  # the link failed (or the fork was aborted) before its sequence came to follow it
            queue = asyncio.Queue()
            queue.put_nowait(LinkFailure(f"decode instance {self.name} failed: {self.error or 'stream closed'}"))
        return queue

    def abort(self, request_id: str, running: bool = False) -> None:
        """Stop routing the request's deltas and ask the decode to abort it (non-blocking); only if its deltas
        were still routed, unless `running` (a request whose queue was dropped while it still runs)."""
        self._reserved.discard(request_id)
        if (self._queues.pop(request_id, None) is not None or running) and self.alive:
            self._outbox.put_nowait(decode_pb2.DecodeIn(abort=decode_pb2.AbortRequest(request_id=request_id)))

    def finish(self, request_id: str) -> None:
        """The request's final delta arrived: forget it (nothing is sent)."""
        self._queues.pop(request_id, None)
        self._reserved.discard(request_id)

    def fail(self, reason: str) -> None:
        """Break the link: every request on it gets a LinkFailure; idempotent."""
        if not self.alive:
            return
        self.alive = False
        self.error = reason
        message = f"decode instance {self.name} failed: {reason}"
        log.log(
            logging.WARNING if self._queues else logging.INFO,
            "%s (%d requests on the stream)",
            message,
            len(self._queues),
        )
        for queue in self._queues.values():
            queue.put_nowait(LinkFailure(message))
        self._queues.clear()
        self._reserved.clear()
        self._outbox.put_nowait(None)
        if self._call is not None:
            self._call.cancel()
        if self._on_broken is not None:
            self._on_broken(self, reason)

    async def close(self) -> None:
        """Fail the link (if alive) and wait for its tasks to end."""
        self.fail("gateway closed the stream")
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        await asyncio.gather(*(t for t in self._tasks if t is not current), return_exceptions=True)

    async def _write(self) -> None:
        assert self._call is not None
        try:
            while True:
                message = await self._outbox.get()
                if message is None or not self.alive:
                    return
                if message is _READ_REPORT:  # the count when it goes out: one report covers every read before
                    self._read_report_queued = False
                    message = decode_pb2.DecodeIn(outputs_read=decode_pb2.OutputsRead(num_outputs=self._num_read))
                await self._call.write(message)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            self.fail(_rpc_reason(exc))
        except Exception as exc:  # InvalidStateError etc. once the call is over
            self.fail(f"cannot write to the stream: {exc!r}")

    async def _read(self) -> None:
        assert self._call is not None
        try:
            async for out in self._call:
                for request_id in out.seats_granted:
                    queue = self._queues.get(request_id)
                    if queue is not None:  # else aborted meanwhile: the decode dropped the seats at the abort
                        queue.put_nowait(SEAT_GRANTED)
                for delta in out.deltas:
                    queue = self._queues.get(delta.request_id)
                    if queue is not None:  # else aborted or unknown: dropped
                        queue.put_nowait(delta)
                self._num_read += 1
                if not self._read_report_queued:
                    self._read_report_queued = True
                    self._outbox.put_nowait(_READ_REPORT)
            reason = "the decode instance closed the stream"
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            reason = _rpc_reason(exc)
        except Exception as exc:
            reason = f"stream read failed: {exc!r}"
        self.fail(reason)


def _rpc_reason(exc: grpc.aio.AioRpcError) -> str:
    return f"{exc.code().name}: {exc.details()}"
