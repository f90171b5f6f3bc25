"""A request's seat on a decode, taken before its prefill, so that a full decode batch delays the first token
rather than the second (docs/architecture.md "Seats"; the decode's side: decode_service/seats.py).

    check_decode_room ──▶ take_seat: SeatRequest ──decode link──▶ SEAT_GRANTED ──▶ Seat (decode, link, queue, timer)
                             └── the decode failed, drained or refused ──▶ the next compatible decode, else 503

The seat's queue is the one the request's deltas come on once it is submitted under the same id; its deadline
timer puts DEADLINE on that queue when the request's time is up.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.gateway.decode_link import DEADLINE, SEAT_GRANTED, DecodeLink, LinkDown, LinkFailure
from splitserve.gateway.errors import GatewayError
from splitserve.gateway.registry import Instance

if TYPE_CHECKING:
    from splitserve.gateway.router import Router


def deadline_timer(queue: asyncio.Queue, deadline: float) -> asyncio.TimerHandle:
    """Put DEADLINE on `queue` at `deadline` (time.monotonic() seconds): one timer per request, not one per awaited
    message."""
    loop = asyncio.get_running_loop()
    return loop.call_at(loop.time() + deadline - time.monotonic(), queue.put_nowait, DEADLINE)


def check_decode_room(router: Router, waiting_ahead: Callable[[int, int], int] | None, share: int) -> None:
    """RESOURCE_EXHAUSTED / 503 with Retry-After when no decode is up, or every up one is full. `waiting_ahead`:
    (share, requests waiting at a decode) -> how many of them a request of `share` waits behind (None: all)."""
    up = router.decode_candidates(None, with_room=False)
    if not up:
        raise GatewayError("resource_exhausted", "no decode instance is up; retry later", retry_after_s=1)
    ahead = functools.partial(waiting_ahead, share) if waiting_ahead is not None else None
    if not any(router.has_room(d, ahead) for d in up):
        full = ", ".join(
            f"{d.name} is draining" if d.describe.draining else f"{d.name} has {router.num_waiting(d)} waiting"
            for d in up
        )
        raise GatewayError(
            "resource_exhausted",
            f"every decode instance is full ({full}; "
            f"max_waiting_per_decode={router.max_waiting_per_decode}); retry later",
            retry_after_s=1,
        )


@dataclass(frozen=True)
class SeatAsk:
    """What a seat reservation asks for: `num_seqs` seats under `internal_id` for a prompt, at a fair `share`,
    held until `deadline` (time.monotonic() seconds)."""

    internal_id: str
    num_seqs: int
    share: int
    prompt_token_ids: list[int]
    deadline: float


@dataclass(frozen=True)
class Seat:
    """Granted seats on `decode`, reserved on its stream `link`: `queue` gets the request's deltas once it is
    submitted under the same id; `timer` puts DEADLINE on it at the request's deadline."""

    decode: Instance
    link: DecodeLink
    queue: asyncio.Queue
    timer: asyncio.TimerHandle


def leave_seat(router: Router, seat: Seat, internal_id: str) -> None:
    """Give back a seat reservation that ended unused (its decode failed, refused, or left)."""
    seat.timer.cancel()
    seat.link.abort(internal_id)  # forgets the id; the decode dropped it already
    router.release(seat.decode)


async def take_seat(router: Router, prefill: Instance, ask: SeatAsk, timeout_message: str) -> Seat:
    """Reserve the request's seats on a decode compatible with `prefill` and wait until that decode grants them:
    the wait for a full batch comes before the first token. A decode that fails or drains meanwhile is left for
    another; with none left, UNAVAILABLE / 503 with Retry-After; at the deadline, DEADLINE_EXCEEDED with
    `timeout_message`. A wait that is cancelled gives its reservation back."""
    tried: list[Instance] = []
    why = ""
    while True:
        candidates = router.decode_candidates(prefill) or router.overflow_candidates(prefill)
        decode = router.pick_decode([d for d in candidates if d not in tried], ask.prompt_token_ids)
        if decode is None:
            raise GatewayError(
                "unavailable",
                f"no decode instance compatible with prefill {prefill.name} is up and not draining{why}; retry later",
                retry_after_s=1,
            )
        tried.append(decode)
        try:
            if decode.link is None:
                raise LinkDown(f"decode instance {decode.name} is not connected")
            hold_s = ask.deadline - time.monotonic()
            queue = decode.link.reserve(ask.internal_id, ask.num_seqs, hold_s, ask.share)
        except LinkDown as exc:
            why = f" ({exc})"
            continue
        router.seat(decode)
        seat = Seat(decode, decode.link, queue, deadline_timer(queue, ask.deadline))
        try:
            item = await queue.get()
        except BaseException:
            leave_seat(router, seat, ask.internal_id)
            raise
        if item is SEAT_GRANTED:
            return seat
        leave_seat(router, seat, ask.internal_id)
        if item is DEADLINE or ask.deadline - time.monotonic() <= 0:  # (the decode lapses it at the same deadline)
            raise GatewayError("deadline_exceeded", timeout_message)
        if isinstance(item, LinkFailure) or item.unavailable:
            why = f" ({item.message if isinstance(item, LinkFailure) else item.error})"
            continue
        raise GatewayError("internal", f"decode instance {decode.name} refused a seat: {item.error}")
