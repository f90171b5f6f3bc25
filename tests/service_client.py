"""A minimal gRPC client of the internal prefill/decode services (what a gateway does), for tests."""

from __future__ import annotations

import asyncio

import grpc

from splitserve.protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc


class DecodeSession:
    """One bidirectional Decode.Generate stream carrying many requests."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = decode_pb2_grpc.DecodeStub(self.channel)
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.results: dict[str, asyncio.Queue] = {}
        self.num_messages = 0
        self.call = self.stub.Generate(self._requests())
        self.reader = asyncio.create_task(self._read())

    async def _requests(self):
        while True:
            item = await self.inbox.get()
            if item is None:
                return
            yield item

    async def _read(self):
        try:
            async for out in self.call:
                self.num_messages += 1
                for delta in out.deltas:
                    self.results.setdefault(delta.request_id, asyncio.Queue()).put_nowait(delta)
        except grpc.aio.AioRpcError as exc:
            for queue in self.results.values():
                queue.put_nowait(exc)

    def submit(self, request: decode_pb2.DecodeRequest) -> asyncio.Queue:
        queue = self.results.setdefault(request.request_id, asyncio.Queue())
        self.inbox.put_nowait(decode_pb2.DecodeIn(request=request))
        return queue

    def abort(self, request_id: str) -> None:
        self.inbox.put_nowait(decode_pb2.DecodeIn(abort=decode_pb2.AbortRequest(request_id=request_id)))

    async def collect(self, request_id: str, timeout_s: float = 60.0) -> tuple[list[int], list]:
        """All token ids of a request until it finishes; returns (tokens, deltas)."""
        queue = self.results.setdefault(request_id, asyncio.Queue())
        tokens, deltas = [], []
        while True:
            delta = await asyncio.wait_for(queue.get(), timeout_s)
            if isinstance(delta, Exception):
                raise delta
            deltas.append(delta)
            tokens.extend(delta.token_ids)
            if delta.finish_reason:
                return tokens, deltas

    async def close(self):
        self.inbox.put_nowait(None)
        self.call.cancel()
        await self.channel.close()


def prefill_stub(address: str) -> prefill_pb2_grpc.PrefillStub:
    return prefill_pb2_grpc.PrefillStub(grpc.aio.insecure_channel(address))


async def describe(address: str, stub_cls=None) -> common_pb2.DescribeResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = (stub_cls or prefill_pb2_grpc.PrefillStub)(channel)
        return await stub.Describe(common_pb2.DescribeRequest(), timeout=10)


def decode_request(
    first: prefill_pb2.PrefillResponse,
    request_id: str,
    prompt: list[int],
    sampling: common_pb2.SamplingParams,
    **fields,
) -> decode_pb2.DecodeRequest:
    """The DecodeRequest a gateway sends once the prefill answered `first` (its first token and KV
    handle); `fields`: more DecodeRequest fields (seed, trace_context, ...)."""
    return decode_pb2.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=sampling,
        first_token_id=first.first_token_id,
        kv=first.kv,
        **fields,
    )


async def generate_disaggregated(
    prefill,
    session: DecodeSession,
    request_id: str,
    prompt: list[int],
    sampling: common_pb2.SamplingParams,
    seed: int = 0,
):
    """Prefill then decode one request; returns (all tokens, prefill response, deltas)."""
    first = await prefill.Prefill(
        prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling, seed=seed),
        timeout=60,
    )
    if first.finish_reason:
        return [first.first_token_id], first, []
    session.submit(decode_request(first, request_id, prompt, sampling, seed=seed))
    tokens, deltas = await session.collect(request_id)
    return [first.first_token_id] + tokens, first, deltas
