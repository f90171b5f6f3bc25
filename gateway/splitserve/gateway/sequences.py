"""Several sequences of one request (OpenAI's n and best_of) as one stream of GenerateResponse messages.

    lead RequestRun (sequence 0) ── prefill ──▶ DecodeRequest(fork_ids = [id~1 .. id~k-1]) ──▶ decode
    SequenceRun i (i = 1..k-1)    ── waits for the lead's submit, then follows id~i on the same stream

The prompt is prefilled once and its KV pulled once; the decode forks the other sequences from it
(engine/scheduling/parallel_sampling.py), sequence i seeded seed + i as vLLM derives them. Messages of all sequences are
merged as they come, each naming its sequence in `index`. With best_of > n nothing streams: when
every sequence has ended, the n of highest cumulative logprob (the sum of the sampled tokens' raw
logprobs, the ones the API returns; ties to the lower index) are sent, one message each, renumbered
0..n-1 in that order.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from splitserve.gateway.decode_link import DecodeLink
from splitserve.gateway.request_run import FR, RequestRun
from splitserve.protos import generation_pb2

_END = object()


class SequenceRun(RequestRun):
    """Sequence `index` > 0: no prefill or routing of its own; its deltas arrive on the lead's decode
    stream under its fork id. Ends with the lead's error when the lead never reached a decode."""

    def __init__(self, lead: RequestRun, **kwargs) -> None:
        super().__init__(lead._deps, **kwargs)
        self._lead = lead
        self._owns_decode = False  # the lead holds the router's assignment
        self._out.lead = lead._out  # the prompt logprobs are computed once, for the lead: every choice has them

    async def _run(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        submitted = await asyncio.shield(self._lead.submitted)
        if submitted is None:
            error = self._lead.error or "the request ended before its decode"
            yield self._out.final(FR.FINISH_REASON_ERROR, error=error)
            return
        self._decode, self._link = submitted
        link: DecodeLink = self._link
        self._local_prefill = self._lead.local_prefill
        self._queue = link.follow(self.internal_id)
        self._start_deadline_timer()
        async with aclosing(self._follow()) as messages:
            async for message in messages:
                yield message

    def _delta_message(self, delta):
        self._lead.forked()  # this sequence runs: the lead, if it ended early, may be aborted now
        return super()._delta_message(delta)


async def merged(runs: Sequence[RequestRun]) -> AsyncIterator[generation_pb2.GenerateResponse]:
    """Every run's messages as they come. A refusal (GatewayError) of any run before the first message
    is raised here; closing the stream closes every run (each aborts its sequence)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: RequestRun) -> None:
        try:
            async with aclosing(run.stream()) as messages:
                async for message in messages:
                    queue.put_nowait(message)
        except Exception as exc:  # a refusal: re-raised to the caller
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(_END)

    tasks = [asyncio.ensure_future(pump(run)) for run in runs]
    try:
        ended = 0
        while ended < len(tasks):
            item = await queue.get()
            if item is _END:
                ended += 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def best_of(
    messages: AsyncIterator[generation_pb2.GenerateResponse], num_sequences: int, n: int, keep_logprobs: bool
) -> AsyncIterator[generation_pb2.GenerateResponse]:
    """The n best of `num_sequences` ended sequences, one collapsed message each (index = rank).
    A sequence that failed fails the request: its error message is the only one sent."""
    parts: list[list[generation_pb2.GenerateResponse]] = [[] for _ in range(num_sequences)]
    async with aclosing(messages) as stream:
        async for message in stream:
            if message.finish_reason == FR.FINISH_REASON_ERROR:
                for rank in range(n):  # every choice ends, with the error
                    failed = generation_pb2.GenerateResponse()
                    failed.CopyFrom(message)
                    failed.index = rank
                    yield failed
                return
            parts[message.index].append(message)
    ranked = sorted(range(num_sequences), key=lambda i: (-_cumulative_logprob(parts[i]), i))
    prompt = parts[0][0]  # the lead's first message: the prompt's ids and logprobs, when asked for
    for rank, index in enumerate(ranked[:n]):
        out = _collapsed(parts[index], rank, keep_logprobs)
        out.prompt_token_ids[:] = prompt.prompt_token_ids
        del out.prompt_logprobs[:]
        out.prompt_logprobs.extend(prompt.prompt_logprobs)
        yield out


def _cumulative_logprob(messages: Sequence[generation_pb2.GenerateResponse]) -> float:
    return sum(lp.logprob for message in messages for lp in message.logprobs)


def _collapsed(
    messages: Sequence[generation_pb2.GenerateResponse], index: int, keep_logprobs: bool
) -> generation_pb2.GenerateResponse:
    """One message holding a sequence's whole output and its last message's end state."""
    out = generation_pb2.GenerateResponse()
    out.CopyFrom(messages[-1])
    out.index = index
    out.text = "".join(m.text for m in messages)
    del out.token_ids[:]
    del out.logprobs[:]
    for message in messages:
        out.token_ids.extend(message.token_ids)
        if keep_logprobs:
            out.logprobs.extend(message.logprobs)
    return out


class Split:
    """The merged stream of an n-sequence request as n streams, `parts[i]` holding index i's messages (a REST
    choice each). Closing every part, or `aclose()`, stops the pump and closes `messages` (every sequence
    aborts); `aclose()` also covers parts never started, as closing a generator that never ran runs none of
    its code."""

    def __init__(
        self, first: generation_pb2.GenerateResponse, messages: AsyncIterator[generation_pb2.GenerateResponse], n: int
    ) -> None:
        self._messages = messages
        self._queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(n)]
        self._queues[first.index].put_nowait(first)
        self._open = n
        self._closed = False
        self._task = asyncio.ensure_future(self._pump())
        self.parts = [self._one(queue) for queue in self._queues]

    async def _pump(self) -> None:
        try:
            async for message in self._messages:
                self._queues[message.index].put_nowait(message)
        except Exception as exc:  # noqa: BLE001 - handed to every reader
            for queue in self._queues:
                queue.put_nowait(exc)

    async def _one(self, queue: asyncio.Queue) -> AsyncIterator[generation_pb2.GenerateResponse]:
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finish_reason:
                    return
        finally:
            self._open -= 1
            if not self._open:
                await self.aclose()

    async def aclose(self) -> None:
        """Stop reading and close the merged stream (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._messages.aclose()
