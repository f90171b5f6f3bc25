"""Seats in a decode's batch, reserved by gateways before they prefill a request.

A gateway streams a request's first token as soon as the prefill answers. If the decode's batch is full then, the
imported request waits in the decode's queue for a running one to end, and the client waits seconds between its
first and second token. So a gateway first asks the decode it chose for a seat (`SeatRequest` on its Generate
stream), prefills once it is granted, and sends the `DecodeRequest`, which claims the seat:

    SeatRequest ─▶ waiting (by share) ─▶ granted (seats_granted) ─▶ DecodeRequest claims it ─▶ a sequence in flight
                        │                   │
                        └── abort, hold past, stream closed, draining ─▶ dropped (the seat is free again)

The decode arbitrates, not the gateway: every gateway process and every gateway shares its seats, and only the
decode counts them all. Seats taken = the sequences the service has in flight (running, waiting, importing; also
those sent without a reservation: a local prefill, a colocated worker's requests) + the seats granted and not yet
claimed, counted as the engine's scheduler counts its sequence cap: only those of the reservation's fair share or
lower (larger shares give up their seats to it, the engine preempts them). The head of the queue (the lowest share;
the first to come among equal shares) is granted while that leaves it room under max_num_seqs; a reservation larger
than max_num_seqs is granted when no seat of its share or lower is taken, so it cannot wait forever.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.protos import common_pb2, decode_pb2


@dataclass
class Reservation:
    """One request's seats on this decode, from its SeatRequest until it is claimed or dropped."""

    owner: object  # the gateway stream that asked (its `out` queue gets the answers)
    request_id: str
    num_seqs: int
    expires_s: float  # the clock's seconds: past it, the reservation is dropped
    granted: bool = False
    share: int = 0  # the caller's fair share: lower ones are granted first
    order: int = 0  # arrival order, among equal shares


@dataclass
class SeatDecisions:
    """What one `SeatBook.pump` decided: reservations granted now, and those dropped with why."""

    granted: list[Reservation] = field(default_factory=list)
    # (reservation, why, unavailable): unavailable = this decode cannot take it (closed), not the request's fault
    dropped: list[tuple[Reservation, str, bool]] = field(default_factory=list)


class SeatBook:
    """The seat reservations of one decode: the waiting ones (granted by share, then arrival) and the granted, not
    yet claimed ones.

    Invariant: a request id is in at most one of the two; `granted_seats` is the sum of the granted ones'
    num_seqs. The book never looks at the engine: the service passes the sequences it has in flight to `pump`.
    """

    def __init__(self, max_num_seqs: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_num_seqs = max_num_seqs
        self._clock = clock
        self._waiting: dict[str, Reservation] = {}
        self._num_reserved = 0  # reservations ever queued: their arrival order
        self._granted: dict[str, Reservation] = {}
        self.granted_seats = 0

    @property
    def num_waiting(self) -> int:
        """Reservations not granted yet (requests this decode will take, waiting for a seat)."""
        return len(self._waiting)

    def holds(self, request_id: str) -> bool:
        return request_id in self._waiting or request_id in self._granted

    def reserve(self, owner: object, request_id: str, num_seqs: int, hold_s: float, share: int = 0) -> None:
        """Queue a reservation (the caller checked that the id is not in use); `pump` grants it."""
        self._num_reserved += 1
        expires_s = self._clock() + hold_s
        r = Reservation(owner, request_id, max(1, num_seqs), expires_s, share=share, order=self._num_reserved)
        self._waiting[request_id] = r

    def claim(self, owner: object, request_id: str) -> bool:
        """The request's DecodeRequest arrived from `owner`: its reservation ends (its sequences now count as in
        flight). False when it held none there (sent without one, or its reservation lapsed)."""
        return self._remove(owner, request_id) is not None

    def cancel(self, owner: object, request_id: str) -> bool:
        """An abort from `owner` before its request came: drop the reservation (False: it held none)."""
        return self._remove(owner, request_id) is not None

    def drop_owner(self, owner: object) -> list[str]:
        """`owner`'s stream closed: drop every reservation it holds; their ids."""
        ids = [r.request_id for r in (*self._waiting.values(), *self._granted.values()) if r.owner is owner]
        for request_id in ids:
            self._remove(owner, request_id)
        return ids

    def pump(self, in_flight: Callable[[int], int], closed: bool = False) -> SeatDecisions:
        """Drop lapsed reservations (every waiting one when `closed`: the decode drains or stops), then grant
        the waiting ones in order while the head fits: `in_flight(share)` (the service's sequences of that share or
        lower) + the granted seats of that share or lower + its num_seqs <= max_num_seqs, or none is taken."""
        decisions, now = SeatDecisions(), self._clock()
        for r in [r for r in (*self._waiting.values(), *self._granted.values()) if r.expires_s <= now]:
            self._remove(r.owner, r.request_id)
            if not r.granted:  # a granted one lapses silently: its request, if it comes, is admitted without
                decisions.dropped.append((r, "its seat reservation lapsed (hold_ms) before a seat was free", False))
        if closed:
            for r in list(self._waiting.values()):
                self._remove(r.owner, r.request_id)
                decisions.dropped.append(
                    (r, "this decode takes no new requests (draining or stopping); try another", True)
                )
        while self._waiting:
            head = min(self._waiting.values(), key=lambda r: (r.share, r.order))
            taken = in_flight(head.share) + sum(r.num_seqs for r in self._granted.values() if r.share <= head.share)
            if taken and taken + head.num_seqs > self.max_num_seqs:
                break
            del self._waiting[head.request_id]
            head.granted = True
            self._granted[head.request_id] = head
            self.granted_seats += head.num_seqs
            decisions.granted.append(head)
        return decisions

    def next_expiry_s(self) -> float | None:
        """The clock's time when the earliest reservation lapses (None: none held)."""
        return min((r.expires_s for r in (*self._waiting.values(), *self._granted.values())), default=None)

    def _remove(self, owner: object, request_id: str) -> Reservation | None:
        r = self._waiting.get(request_id) or self._granted.get(request_id)
        if r is None or r.owner is not owner:
            return None
        if r.granted:
            del self._granted[request_id]
            self.granted_seats -= r.num_seqs
        else:
            del self._waiting[request_id]
        return r


def send_decisions(decisions: SeatDecisions) -> None:
    """Answer each decision on its stream: one DecodeOut of the grants per stream, an error delta per drop."""
    grants: dict[int, tuple[object, list[str]]] = {}
    for r in decisions.granted:
        grants.setdefault(id(r.owner), (r.owner, []))[1].append(r.request_id)
    for owner, ids in grants.values():
        owner.out.put_nowait(decode_pb2.DecodeOut(seats_granted=ids))
    for r, why, unavailable in decisions.dropped:
        delta = decode_pb2.TokenDelta(
            request_id=r.request_id, finish_reason=common_pb2.FINISH_REASON_ERROR, error=why, unavailable=unavailable
        )
        r.owner.out.put_nowait(decode_pb2.DecodeOut(deltas=[delta]))


class SeatDesk:
    """A decode service's seats: the book, answers on the streams, and a timer for the next reservation to lapse.

    `in_flight(share)` (sequences of that share or lower) and `closed` (draining, starting or its core gone) read
    the service's state when the desk pumps.
    """

    def __init__(self, in_flight: Callable[[int], int], closed: Callable[[], bool]) -> None:
        self.book = SeatBook(max_num_seqs=0)  # the core's max_num_seqs, set once the core runs
        self._in_flight = in_flight
        self._closed = closed
        self._timer: asyncio.TimerHandle | None = None

    def reserve(self, owner: object, seat: decode_pb2.SeatRequest, refusal: str) -> None:
        """Queue a SeatRequest (answered when granted), or answer `refusal` at once when it is not empty."""
        if refusal:
            delta = decode_pb2.TokenDelta(
                request_id=seat.request_id, finish_reason=common_pb2.FINISH_REASON_ERROR, error=refusal
            )
            delta.unavailable = self._closed()
            owner.out.put_nowait(decode_pb2.DecodeOut(deltas=[delta]))
            return
        self.book.reserve(owner, seat.request_id, seat.num_seqs, seat.hold_ms / 1000, seat.share)
        self.pump()

    def pump(self) -> None:
        """Grant the reservations that fit now, drop lapsed ones, and wake again when the next one lapses."""
        send_decisions(self.book.pump(self._in_flight, closed=self._closed()))
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        expiry_s = self.book.next_expiry_s()
        if expiry_s is not None:
            delay_s = max(0.0, expiry_s - time.monotonic()) + 0.001
            self._timer = asyncio.get_running_loop().call_later(delay_s, self.pump)
