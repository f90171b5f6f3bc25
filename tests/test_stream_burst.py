"""Issue 22.4: a burst of concurrent gRPC streams. gRPC's server queues a call its handler has not picked
up yet and, past 1,000 queued, cancels new ones at random: the client saw a bare CANCELLED (no message)
that no handler and no counter saw. Every stream must end with a finish reason or a status that names
its cause, and every one must be counted."""

from __future__ import annotations

import asyncio
import collections

import grpc
import httpx
import pytest

from splitserve.protos import common_pb2, generation_pb2, generation_pb2_grpc
from tests.gateway_fakes import FakeDecode, FakePrefill, Stack, make_tokenizer_dir, parse_metrics

pytestmark = pytest.mark.slow
NUM_STREAMS = 2000  # over gRPC's 1,000-call queue when opened at once
MAX_TOKENS = 4


async def burst(target: str, num_streams: int) -> collections.Counter:
    """Open every stream at once on one channel; count how each ended."""
    ended = collections.Counter()
    request = generation_pb2.GenerateRequest(text="w20", sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS))
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one() -> None:
            tokens, reason = [], None
            try:
                async for message in stub.Generate(request, timeout=120):
                    tokens += message.token_ids
                    reason = message.finish_reason or reason
                ended[(common_pb2.FinishReason.Name(reason), tuple(tokens))] += 1
            except grpc.aio.AioRpcError as exc:
                ended[(exc.code().name, exc.details())] += 1

        await asyncio.gather(*(one() for _ in range(num_streams)))
    return ended


def test_a_burst_of_streams_all_reach_the_gateway_and_end_named(tmp_path):
    decode = FakeDecode(step_s=0.05, free_blocks=1 << 20)
    limits = {"max_concurrent_requests": 4096, "max_waiting_per_decode": 1 << 16}
    stack = Stack(make_tokenizer_dir(str(tmp_path)), [FakePrefill()], [decode], limits).start()
    try:
        ended = asyncio.run(burst(stack.grpc_target, NUM_STREAMS))
        metrics = parse_metrics(httpx.get(f"{stack.base_url}/metrics", timeout=10).text)
        ready = httpx.get(f"{stack.base_url}/ready", timeout=10).json()
    finally:
        stack.stop()
    assert dict(ended) == {("FINISH_REASON_LENGTH", (21, 22, 23, 24)): NUM_STREAMS}
    route = ("route", "/splitserve.v1.Generation/Generate")
    assert metrics[("splitserve:requests_total", (route, ("status", "OK")))] == NUM_STREAMS
    assert [i["up"] for i in ready["instances"]] == [True, True]  # no instance marked down meanwhile
