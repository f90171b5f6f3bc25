"""A gateway stream's pacing: merged steps keep every token in order and each request's end state; a paced
stream waits for the gateway's reads, an unpaced one never does."""

import asyncio

import pytest

from splitserve.decode_service.stream_pacing import MAX_UNREAD, OutputPacer, merge_outs
from splitserve.protos import common_pb2, decode_pb2

FR = common_pb2.FinishReason


async def loop_turns(n: int) -> None:
    """Let the other tasks run `n` turns of the loop (a task that could go on would have)."""
    for _ in range(n):
        await asyncio.sleep(0)


def delta(rid: str, *ids: int, **fields) -> decode_pb2.TokenDelta:
    return decode_pb2.TokenDelta(request_id=rid, token_ids=ids, **fields)


def test_merged_steps_hold_each_requests_tokens_in_order_with_its_first_and_last_fields():
    timings = common_pb2.Timings(decode_ns=7)
    outs = [
        decode_pb2.DecodeOut(deltas=[delta("a", 1, cached_prompt_tokens=8, num_blocks_pulled=3), delta("b", 10)]),
        decode_pb2.DecodeOut(deltas=[delta("b", 11), delta("c", 20, num_blocks_pulled=2)], step_ns=5),
        decode_pb2.DecodeOut(
            deltas=[delta("a", 2, finish_reason=FR.FINISH_REASON_LENGTH, timings=timings), delta("c", 21)],
            step_ns=9,
        ),
    ]
    merged = merge_outs(outs)
    assert merged == decode_pb2.DecodeOut(
        deltas=[
            delta(
                "a",
                1,
                2,
                cached_prompt_tokens=8,
                num_blocks_pulled=3,
                finish_reason=FR.FINISH_REASON_LENGTH,
                timings=timings,
            ),
            delta("b", 10, 11),
            delta("c", 20, 21, num_blocks_pulled=2),
        ],
        step_ns=9,
    )
    assert outs[0].deltas[0].token_ids == [1]  # the inputs are left as they were


def test_one_message_is_sent_as_it_is():
    out = decode_pb2.DecodeOut(deltas=[delta("a", 1)], step_ns=3)
    assert merge_outs([out]) is out


def test_an_error_delta_after_tokens_keeps_the_tokens_and_ends_with_the_error():
    error = delta("a", finish_reason=FR.FINISH_REASON_ERROR, error="core died", unavailable=True)
    merged = merge_outs([decode_pb2.DecodeOut(deltas=[delta("a", 4)]), decode_pb2.DecodeOut(deltas=[error])])
    assert list(merged.deltas) == [
        delta("a", 4, finish_reason=FR.FINISH_REASON_ERROR, error="core died", unavailable=True)
    ]


def test_a_paced_stream_waits_for_reads_and_an_unpaced_one_never_does():
    async def main():
        pacer = OutputPacer()
        pacer.num_sent = 10
        await asyncio.wait_for(pacer.wait_for_room(), 1)  # unpaced: never waits
        pacer.on_read(10 - MAX_UNREAD)
        waiting = asyncio.create_task(pacer.wait_for_room())
        await loop_turns(5)
        assert not waiting.done()
        pacer.on_read(3)  # a late report of fewer reads changes nothing
        await loop_turns(5)
        assert not waiting.done() and pacer.num_read == 10 - MAX_UNREAD
        pacer.on_read(10 - MAX_UNREAD + 1)
        await asyncio.wait_for(waiting, 1)
        pacer.num_sent += 1
        waiting = asyncio.create_task(pacer.wait_for_room())
        await loop_turns(5)
        assert not waiting.done()
        pacer.on_closed()  # the gateway's side ended: no read will come
        await asyncio.wait_for(waiting, 1)

    asyncio.run(main())


@pytest.mark.parametrize("unread", range(MAX_UNREAD))
def test_fewer_than_max_unread_leaves_room(unread):
    async def main():
        pacer = OutputPacer()
        pacer.on_read(5)
        pacer.num_sent = 5 + unread
        await asyncio.wait_for(pacer.wait_for_room(), 1)

    asyncio.run(main())
