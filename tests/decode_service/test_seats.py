"""Seat reservations on a decode (decode_service/seats.py): granted in arrival order while the batch has room,
given back on every path (claimed, aborted, stream closed, lapsed, draining), and the service's use of them."""

import asyncio
from types import SimpleNamespace

from splitserve.common.config import EngineConfig
from splitserve.common.default_model_path import default_model_path
from splitserve.decode_service import server
from splitserve.decode_service.seats import Reservation, SeatBook, SeatDecisions, send_decisions
from splitserve.engine_service.config import ServiceConfig
from splitserve.protos import common_pb2, decode_pb2
from tests.service_harness import wait_until_async

ERROR = common_pb2.FINISH_REASON_ERROR


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class Owner:
    """A gateway stream as the book sees it: something with an `out` queue."""

    def __init__(self) -> None:
        self.out: asyncio.Queue = asyncio.Queue()


def seqs(num: int):
    """The service's sequences in flight, `num` of every share."""
    return lambda share: num


def granted(decisions: SeatDecisions) -> list[str]:
    return [r.request_id for r in decisions.granted]


def dropped(decisions: SeatDecisions) -> list[tuple[str, str, bool]]:
    return [(r.request_id, why, unavailable) for r, why, unavailable in decisions.dropped]


def test_seats_are_granted_in_arrival_order_while_the_batch_has_room():
    book, a, b = SeatBook(max_num_seqs=2, clock=Clock()), object(), object()
    for owner, request_id in [(a, "r1"), (b, "r2"), (a, "r3")]:
        book.reserve(owner, request_id, 1, hold_s=60)
    assert granted(book.pump(seqs(0))) == ["r1", "r2"]
    assert (book.num_waiting, book.granted_seats) == (1, 2)
    assert granted(book.pump(seqs(0))) == []  # two seats granted, not claimed yet: none free
    assert book.claim(a, "r1") and book.claim(b, "r2")  # their requests came: two sequences in flight
    assert granted(book.pump(seqs(2))) == [] and book.granted_seats == 0
    assert granted(book.pump(seqs(1))) == ["r3"]  # one of them ended
    assert (book.num_waiting, book.granted_seats) == (0, 1)


def test_a_lower_share_is_granted_first_and_equal_shares_in_arrival_order():
    """One caller with many requests in flight (share 40) waits behind another with few (share 1), as the engine's
    scheduler orders them."""
    book, owner = SeatBook(max_num_seqs=1, clock=Clock()), object()
    for request_id, share in [("big-1", 40), ("big-2", 40), ("small-1", 1), ("big-3", 40), ("small-2", 1)]:
        book.reserve(owner, request_id, 1, hold_s=60, share=share)
    order = []
    while book.num_waiting:
        (r,) = book.pump(seqs(0)).granted
        order.append(r.request_id)
        assert book.claim(owner, r.request_id)
    assert order == ["small-1", "small-2", "big-1", "big-2", "big-3"]


def test_seats_held_by_larger_shares_are_given_up_to_a_smaller_one():
    """As the engine's sequence cap counts: a caller with few requests in flight gets a seat from a batch full of
    another caller's many (the engine preempts those); equal and larger shares wait."""
    book, owner = SeatBook(max_num_seqs=2, clock=Clock()), object()
    in_flight = {8: 2}  # share -> sequences: a batch full of share 8

    def at_or_below(share: int) -> int:
        return sum(n for s, n in in_flight.items() if s <= share)

    book.reserve(owner, "same", 1, hold_s=60, share=8)
    book.reserve(owner, "small", 1, hold_s=60, share=1)
    book.reserve(owner, "small-2", 2, hold_s=60, share=1)
    assert granted(book.pump(at_or_below)) == ["small"]  # 0 of share <= 1 in flight: 0 + 1 <= 2
    assert granted(book.pump(at_or_below)) == []  # small-2: 1 granted of share 1 + 2 > 2
    assert book.claim(owner, "small")
    in_flight[1] = 1  # small runs
    assert granted(book.pump(at_or_below)) == []  # small-2 needs 2, share 1 holds 1
    in_flight.pop(1)  # small ended; the share-8 sequences still run
    assert granted(book.pump(at_or_below)) == ["small-2"]
    assert granted(book.pump(at_or_below)) == []  # "same" (share 8): 2 in flight and small-2's 2 granted


def test_the_head_waits_for_all_its_seats_and_a_larger_reservation_than_the_batch_waits_for_an_empty_one():
    book, owner = SeatBook(max_num_seqs=4, clock=Clock()), object()
    book.reserve(owner, "n3", 3, hold_s=60)
    book.reserve(owner, "n1", 1, hold_s=60)
    assert granted(book.pump(seqs(2))) == []  # 2 + 3 > 4: the head waits, and the one behind it too
    assert granted(book.pump(seqs(1))) == ["n3"]  # 1 + 3 = 4: it fits
    assert granted(book.pump(seqs(1))) == []  # n1: 1 + 3 + 1 > 4
    assert granted(book.pump(seqs(0))) == ["n1"]  # 3 + 1 = 4
    book.reserve(owner, "n9", 9, hold_s=60)
    assert granted(book.pump(seqs(0))) == []  # more than the batch: waits until no seat is taken
    assert book.cancel(owner, "n3") and book.claim(owner, "n1")
    assert granted(book.pump(seqs(1))) == []
    assert granted(book.pump(seqs(0))) == ["n9"] and book.granted_seats == 9


def test_every_way_a_reservation_ends_frees_its_seat():
    book, a, b = SeatBook(max_num_seqs=1, clock=Clock()), object(), object()
    book.reserve(a, "granted", 1, hold_s=60)
    book.reserve(a, "waiting", 1, hold_s=60)
    book.reserve(b, "other", 1, hold_s=60)
    assert granted(book.pump(seqs(0))) == ["granted"]
    assert not book.cancel(b, "granted") and not book.claim(b, "waiting")  # another stream's: untouched
    assert book.cancel(a, "granted")  # aborted after the grant: the next one gets the seat
    assert granted(book.pump(seqs(0))) == ["waiting"]
    assert book.cancel(b, "other") and book.num_waiting == 0  # aborted while waiting
    book.reserve(b, "later", 1, hold_s=60)
    assert book.drop_owner(a) == ["waiting"]  # a's stream closed
    assert granted(book.pump(seqs(0))) == ["later"]
    assert book.claim(b, "later") and not book.holds("later") and book.granted_seats == 0
    assert not book.cancel(b, "later") and book.drop_owner(b) == []  # claimed: nothing left to drop


def test_reservations_lapse_at_their_hold_and_a_draining_decode_drops_the_waiting_ones():
    clock = Clock()
    book, owner = SeatBook(max_num_seqs=1, clock=clock), object()
    book.reserve(owner, "first", 1, hold_s=5)
    book.reserve(owner, "second", 1, hold_s=10)
    book.reserve(owner, "third", 1, hold_s=30)
    assert granted(book.pump(seqs(0))) == ["first"] and book.next_expiry_s() == 105.0
    clock.now_s = 105.0  # the first was granted and never claimed: it lapses silently, its seat goes on
    decisions = book.pump(seqs(0))
    assert (granted(decisions), dropped(decisions)) == (["second"], [])
    book.reserve(owner, "fourth", 1, hold_s=1)
    clock.now_s = 110.0  # second lapses too; fourth lapses while waiting: its gateway hears why
    decisions = book.pump(seqs(0))
    assert granted(decisions) == ["third"]
    assert dropped(decisions) == [("fourth", "its seat reservation lapsed (hold_ms) before a seat was free", False)]
    book.reserve(owner, "fifth", 1, hold_s=60)
    decisions = book.pump(seqs(0), closed=True)
    assert dropped(decisions) == [
        ("fifth", "this decode takes no new requests (draining or stopping); try another", True)
    ]
    assert book.holds("third") and book.next_expiry_s() == 130.0  # granted ones stay until claimed or lapsed


def test_answers_go_to_the_stream_that_asked():
    async def main():
        a, b = Owner(), Owner()
        decisions = SeatDecisions(
            granted=[Reservation(a, "r1", 1, 0.0), Reservation(b, "r2", 1, 0.0), Reservation(a, "r3", 2, 0.0)],
            dropped=[
                (
                    Reservation(b, "r4", 1, 0.0),
                    "this decode takes no new requests (draining or stopping); try another",
                    True,
                )
            ],
        )
        send_decisions(decisions)
        assert [list(out.seats_granted) for out in drain(a)] == [["r1", "r3"]]  # one message per stream
        grants, drop = drain(b)
        (delta,) = drop.deltas
        assert list(grants.seats_granted) == ["r2"] and not grants.deltas
        assert (delta.request_id, delta.finish_reason, delta.error, delta.unavailable) == (
            "r4",
            ERROR,
            "this decode takes no new requests (draining or stopping); try another",
            True,
        )

    def drain(owner: Owner) -> list:
        outs = []
        while not owner.out.empty():
            outs.append(owner.out.get_nowait())
        return outs

    asyncio.run(main())


def service() -> server.DecodeService:
    svc = server.DecodeService(EngineConfig(model=str(default_model_path()), role="decode"), ServiceConfig())
    svc.starting = False
    svc.client.info = SimpleNamespace(vocab_size=512, max_num_seqs=1)
    svc.seats.book.max_num_seqs = 1
    svc.client.send = lambda msg: None
    return svc


def seat(request_id: str, hold_ms: int = 60_000) -> decode_pb2.SeatRequest:
    return decode_pb2.SeatRequest(request_id=request_id, num_seqs=1, hold_ms=hold_ms)


def test_the_decode_grants_a_waiting_seat_when_a_request_ends_and_drops_a_closed_streams():
    async def main():
        svc, a, b, c = service(), server.GatewayStream(), server.GatewayStream(), server.GatewayStream()
        svc._reserve(seat("r1"), a)
        assert list(a.out.get_nowait().seats_granted) == ["r1"]
        svc._reserve(seat("r2"), b)
        svc._reserve(seat("r3"), c)
        assert b.out.empty() and svc.seats.book.num_waiting == 2
        svc._admit(decode_pb2.DecodeRequest(request_id="r1", prompt_token_ids=[1, 2]), a)  # claims r1's seat
        assert svc.inflight == 1 and not svc.seats.book.holds("r1") and b.out.empty()
        svc._abort_stream(b)  # b's gateway went away while r2 waited
        svc.finish_request("r1")
        assert list(c.out.get_nowait().seats_granted) == ["r3"] and b.out.empty()
        svc._reserve(seat("r3"), a)  # an id in use (reserved) is refused, the first keeps its seat
        (delta,) = a.out.get_nowait().deltas
        assert (delta.request_id, delta.finish_reason, delta.error, delta.unavailable) == (
            "r3",
            ERROR,
            "request_id 'r3' is already in use",
            False,
        )
        assert svc.seats.book.holds("r3")

    asyncio.run(main())


def test_a_lapsed_reservation_is_answered_and_a_draining_decode_refuses_new_ones():
    async def main():
        svc, a, b = service(), server.GatewayStream(), server.GatewayStream()
        svc._admit(decode_pb2.DecodeRequest(request_id="seated", prompt_token_ids=[1, 2]), a)  # no reservation
        svc._reserve(seat("short", hold_ms=50), b)
        out = await wait_until_async(
            lambda: _first(b.out), timeout_s=5, message="the lapsed reservation answered", poll_s=0.01
        )
        (delta,) = out.deltas
        assert (delta.request_id, delta.error, delta.unavailable) == (
            "short",
            "its seat reservation lapsed (hold_ms) before a seat was free",
            False,
        )
        assert svc.seats.book.num_waiting == 0
        svc.draining = True
        svc._reserve(seat("late"), b)
        (delta,) = b.out.get_nowait().deltas
        assert (delta.request_id, delta.error, delta.unavailable) == ("late", f"{svc.name} is draining", True)

    asyncio.run(main())


async def _first(queue: asyncio.Queue):
    return None if queue.empty() else queue.get_nowait()
