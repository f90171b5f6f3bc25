"""A burst of concurrent gRPC streams. gRPC's server queues a call its handler has not picked
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
from tests.service_harness import wait_until

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
    assert metrics[("splitserve:gateway_requests_total", (route, ("status", "OK")))] == NUM_STREAMS
    assert [i["up"] for i in ready["instances"]] == [True, True]  # no instance marked down meanwhile


def test_calls_the_server_picks_up_late_still_reach_their_handler():
    """An internal server whose event loop is held for 33 s (a loaded machine): gRPC cancelled every call
    it had queued for over 30 s (a bare CANCELLED); now each is answered once the loop is back."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from splitserve.runtime.grpc_server import build_server

    held = threading.Event()  # set once the handler holds the loop

    async def handler(request: bytes, context) -> bytes:
        if request == b"hold":
            held.set()
            time.sleep(33)  # holds the event loop (a coroutine, not run on a thread): no call is picked up
        return request

    same = bytes
    method = grpc.unary_unary_rpc_method_handler(handler, same, same)
    generic = grpc.method_handlers_generic_handler("t.Held", {"Echo": method})

    async def serve_and_call() -> collections.Counter:
        server, _, port = build_server("127.0.0.1", 0, lambda s: s.add_generic_rpc_handlers((generic,)), ["t.Held"])
        await server.start()
        try:
            return await asyncio.to_thread(call_from_threads, port)
        finally:
            await server.stop(0)

    def call_from_threads(port: int) -> collections.Counter:
        ended = collections.Counter()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            echo = channel.unary_unary("/t.Held/Echo", request_serializer=same, response_deserializer=same)
            holder = threading.Thread(target=lambda: echo(b"hold", timeout=120))
            holder.start()
            wait_until(held.is_set, 30, "the server to pick up the holding call")  # the loop is held from here

            def one(i: int) -> None:
                try:
                    ended[echo(b"%d" % i, timeout=120) == b"%d" % i] += 1
                except grpc.RpcError as exc:
                    ended[(exc.code().name, exc.details())] += 1

            with ThreadPoolExecutor(8) as pool:
                list(pool.map(one, range(8)))
            holder.join()
        return ended

    assert dict(asyncio.run(serve_and_call())) == {True: 8}
