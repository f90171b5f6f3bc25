"""A burst of concurrent gRPC streams, and how each one ended (issue 22.4).

    python -m bench.stream_burst bare [--streams 3000] [--queue grpc-default|ours]
    python -m bench.stream_burst gateway --target 127.0.0.1:50051 [--http http://127.0.0.1:8000] [--streams 3000]

`bare`: a grpc.aio server whose handler streams 20 messages 50 ms apart, and a grpc.aio client opening
every stream at once on one channel: nothing of ours, to show where bare CANCELLED comes from (gRPC's
queue of calls the server has not picked up yet: random rejections over 1,000, all over 3,000) and
that the server options in engine/runtime/grpc_server.py (SERVER_QUEUE_OPTIONS) remove it.
`gateway`: the same burst of Generation.Generate streams against a running gateway (e.g. `splitserve
up`); with --http, also whether /ready still has every instance up afterwards and the gateway's
requests_total by status. Prints one row per way a stream ended ("OK <finish reason>", or the status
code and its message; a bare CANCELLED reads "CANCELLED (no message)").
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time

import grpc


def outcome_of(exc: grpc.aio.AioRpcError) -> str:
    details = exc.details() or "(no message)"
    return f"{exc.code().name} {details[:90]}"


async def gateway_burst(
    target: str, num_streams: int, max_tokens: int = 8, num_channels: int = 1, metadata=()
) -> tuple[collections.Counter, float]:
    """Open num_streams Generate streams at once over num_channels; (how each ended, seconds)."""
    from splitserve.protos import common_pb2, generation_pb2, generation_pb2_grpc

    ended: collections.Counter = collections.Counter()
    request = generation_pb2.GenerateRequest(
        text="def fibonacci(n):", sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    )
    channels = [
        grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(num_channels)
    ]
    stubs = [generation_pb2_grpc.GenerationStub(c) for c in channels]

    async def one(i: int) -> None:
        reason = 0
        try:
            async for message in stubs[i % num_channels].Generate(request, timeout=600, metadata=metadata):
                reason = message.finish_reason or reason
            ended["OK " + common_pb2.FinishReason.Name(reason)] += 1
        except grpc.aio.AioRpcError as exc:
            ended[outcome_of(exc)] += 1

    start = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(num_streams)))
    elapsed = time.monotonic() - start
    for channel in channels:
        await channel.close()
    return ended, elapsed


async def bare_burst(num_streams: int, queue: str) -> tuple[collections.Counter, float, int]:
    """A bare grpc.aio server and client; (how each stream ended, seconds, handlers started)."""
    from splitserve.runtime.grpc_server import SERVER_QUEUE_OPTIONS

    started = 0

    async def handler(request, context):
        nonlocal started
        started += 1
        for _ in range(20):
            await asyncio.sleep(0.05)
            yield b"x" * 16

    same = lambda b: b  # noqa: E731
    server = grpc.aio.server(options=SERVER_QUEUE_OPTIONS if queue == "ours" else [])
    method = grpc.unary_stream_rpc_method_handler(handler, same, same)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("b.S", {"M": method}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ended: collections.Counter = collections.Counter()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream("/b.S/M", request_serializer=same, response_deserializer=same)

        async def one() -> None:
            try:
                ended[f"OK {sum(1 for _ in [m async for m in call(b'', timeout=600)])} messages"] += 1
            except grpc.aio.AioRpcError as exc:
                ended[outcome_of(exc)] += 1

        start = time.monotonic()
        await asyncio.gather(*(one() for _ in range(num_streams)))
        elapsed = time.monotonic() - start
    await server.stop(0)
    return ended, elapsed, started


def gateway_state(http: str) -> tuple[list[bool], dict[str, float]]:
    """(/ready's instances' up flags, the gateway's Generate requests_total by status)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    ready = httpx.get(f"{http}/ready", timeout=30).json()
    totals = {}
    for family in text_string_to_metric_families(httpx.get(f"{http}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == "splitserve:requests_total" and s.labels.get("route", "").endswith("/Generate"):
                totals[s.labels["status"]] = s.value
    return [i["up"] for i in ready.get("instances", [])], totals


def print_counts(title: str, ended: collections.Counter, elapsed: float) -> None:
    print(f"{title}: {sum(ended.values())} streams in {elapsed:.1f} s")
    print("| streams | how they ended |\n|---:|---|")
    for what, n in ended.most_common():
        print(f"| {n} | {what} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("bare", "gateway"))
    ap.add_argument("--streams", type=int, default=3000)
    ap.add_argument("--queue", choices=("grpc-default", "ours"), default="ours", help="bare: the server's options")
    ap.add_argument("--target", default="127.0.0.1:50051", help="gateway: its gRPC address")
    ap.add_argument("--http", default="", help="gateway: its REST base URL (for /ready and /metrics)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--channels", type=int, default=1)
    args = ap.parse_args()
    if args.mode == "bare":
        ended, elapsed, started = asyncio.run(bare_burst(args.streams, args.queue))
        print_counts(f"bare grpc.aio, server queue {args.queue}, {started} handlers started", ended, elapsed)
        return
    ended, elapsed = asyncio.run(gateway_burst(args.target, args.streams, args.max_tokens, args.channels))
    print_counts(f"gateway {args.target}", ended, elapsed)
    if args.http:
        up, totals = gateway_state(args.http)
        print(f"instances up afterwards: {up}; requests_total (Generate) by status: {totals}")


if __name__ == "__main__":
    main()
