"""Pacing of one gateway stream's outputs: the engine steps at its own rate, the gateway reads at its own.

A gateway reads one `DecodeOut` a turn of its event loop. When its loop is busier than the engine's step, the
messages it has not read pile up in gRPC's buffers (the flow-control window grows to megabytes), every token
it reads is older than the last, and a new stream's first token (from the prefill) is followed by a wait as long
as that queue: seconds at 256 streams on one GPU, while every later gap stays one loop turn. A gateway that paces
its stream tells the decode how many messages it has read (`OutputsRead`); the decode then keeps at most
MAX_UNREAD of them unread and merges the steps produced meanwhile into the next message, one delta per request,
so the gateway gets more tokens a message and never reads an old step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from splitserve.protos import decode_pb2

# DecodeOut messages a paced gateway may have unread: enough that a gateway keeping up never waits for its own
# OutputsRead to come back (one step in flight while the next is written), few enough that a lagging one reads
# steps at most this many messages old.
MAX_UNREAD = 2


class OutputPacer:
    """The read count of one stream: None until the gateway first sends OutputsRead (an unpaced stream)."""

    def __init__(self) -> None:
        self.num_sent = 0
        self.num_read: int | None = None
        self._changed = asyncio.Event()

    def on_read(self, num_outputs: int) -> None:
        """The gateway's OutputsRead (a running count; one arriving late never moves it back)."""
        self.num_read = max(self.num_read or 0, num_outputs)
        self._changed.set()

    def on_closed(self) -> None:
        """The gateway's side ended: stop waiting for reads that will not come."""
        self.num_read = None
        self._changed.set()

    async def wait_for_room(self) -> None:
        """Until the stream may carry one more message."""
        while self.num_read is not None and self.num_sent - self.num_read >= MAX_UNREAD:
            self._changed.clear()
            await self._changed.wait()


def merge_outs(outs: Sequence[decode_pb2.DecodeOut]) -> decode_pb2.DecodeOut:
    """One message holding several steps' outputs in order: a request's deltas become one (its tokens and
    logprobs concatenated, the first's one-off fields, the last's end state); requests keep the order in which
    they first appear; the seats granted meanwhile, in order."""
    if len(outs) == 1:
        return outs[0]
    merged: dict[str, decode_pb2.TokenDelta] = {}
    for out in outs:
        for delta in out.deltas:
            into = merged.get(delta.request_id)
            if into is None:
                merged[delta.request_id] = into = decode_pb2.TokenDelta()
                into.CopyFrom(delta)
                continue
            into.token_ids.extend(delta.token_ids)
            into.logprobs.extend(delta.logprobs)
            into.prompt_logprobs.extend(delta.prompt_logprobs)  # computed once, so at most one delta has them
            into.cached_prompt_tokens = into.cached_prompt_tokens or delta.cached_prompt_tokens
            into.num_blocks_pulled = into.num_blocks_pulled or delta.num_blocks_pulled
            into.finish_reason, into.error = delta.finish_reason, delta.error
            into.refused, into.unavailable = delta.refused, delta.unavailable
            if delta.HasField("timings"):
                into.timings.CopyFrom(delta.timings)
    step_ns = next((out.step_ns for out in reversed(outs) if out.step_ns), 0)  # a grant alone has none
    seats_granted = [request_id for out in outs for request_id in out.seats_granted]
    return decode_pb2.DecodeOut(deltas=list(merged.values()), step_ns=step_ns, seats_granted=seats_granted)
