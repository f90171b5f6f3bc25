"""A small caller's latency while another caller floods a CPU `splitserve up`, and the flood's throughput.

    python benchmarks/flood_latency.py [--variant LABEL=UP_FLAGS ...] [--rounds 2] [--json out.json]

The shape of the hostile run's finding 6: one caller (API key) streams --prompts gRPC Generate calls at once,
each n=--n sequences of --max-tokens sampled tokens (temperature 1, ignore_eos; 8-token random prompts), so
prompts x n sequences want the decode at once; once every flood call has its first tokens and --warm-s more have
passed, a third caller sends --small 8-token REST completions one after another. Per variant and round: each
small request's seconds, and the flood's tokens/s (token ids streamed to the flood's calls, counted over the
small requests' window). Variants run in turn each round (same machine load); the 1-minute load average is
read before and after each. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import httpx
from up_load import UpProcess, Variant

from splitserve.bench.serve_launch import HOST
from splitserve.protos import common_pb2, generation_pb2, generation_pb2_grpc

FLOODER, SMALL_CALLER = "flood-caller", "small-caller"
SMALL = {"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 8, "ignore_eos": True}


class Flood:
    """--prompts Generate streams of one caller; counts the token ids each message carries, with their times."""

    def __init__(self, port: int, num_prompts: int, n: int, max_tokens: int) -> None:
        rng = random.Random(11)
        self.requests = [
            generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=[rng.randrange(3, 8192) for _ in range(8)]),
                sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0),
                n=n,
            )
            for _ in range(num_prompts)
        ]
        self.port = port
        self.events: list[tuple[float, int]] = []  # (time.monotonic(), token ids in the message)
        self.started: set[int] = set()  # flood calls that got a token

    async def run(self) -> None:
        metadata = (("authorization", f"Bearer {FLOODER}"),)
        async with grpc.aio.insecure_channel(f"{HOST}:{self.port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            async def one(i: int, request) -> None:
                async for message in stub.Generate(request, metadata=metadata, timeout=900):
                    self.events.append((time.monotonic(), len(message.token_ids)))
                    self.started.add(i)

            await asyncio.gather(*(one(i, r) for i, r in enumerate(self.requests)))

    def tokens_between(self, start: float, end: float) -> int:
        return sum(n for t, n in self.events if start <= t <= end)


async def one_variant(variant: Variant, args, tmp: Path) -> dict:
    keys = tmp / "keys"
    keys.write_text(f"{FLOODER}\n{SMALL_CALLER}\n")
    load = [round(os.getloadavg()[0], 2)]
    up = UpProcess(Variant(variant.label, ("--api-keys-file", str(keys), *variant.up_flags)), tmp, 300)
    base = f"http://{HOST}:{up.http_port}"
    try:
        flood = Flood(up.grpc_port, args.prompts, args.n, args.max_tokens)
        task = asyncio.ensure_future(flood.run())
        deadline = time.monotonic() + 120
        while len(flood.started) < args.prompts and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.1)  # a benchmark polling its own counters: no condition object to wait on
        await asyncio.sleep(args.warm_s)
        small = []
        window_start = time.monotonic()
        async with httpx.AsyncClient(timeout=120, headers={"Authorization": f"Bearer {SMALL_CALLER}"}) as client:
            for _ in range(args.small):
                start = time.monotonic()
                r = await client.post(base + "/v1/completions", json=SMALL)
                small.append((r.status_code, round(time.monotonic() - start, 3)))
        window_end = time.monotonic()
        still = not task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        up.stop()
    load.append(round(os.getloadavg()[0], 2))
    rate = flood.tokens_between(window_start, window_end) / (window_end - window_start)
    return {
        "variant": variant.label,
        "up_flags": list(variant.up_flags),
        "small_s": [s for _, s in small],
        "small_codes": [c for c, _ in small],
        "flood_tok_s": round(rate, 1),
        "flood_still_ran": still,
        "flood_calls_started": len(flood.started),
        "load": load,
    }


def parse_variant(text: str) -> Variant:
    label, _, flags = text.partition("=")
    return Variant(label, tuple(shlex.split(flags)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", type=parse_variant, help="LABEL=UP_FLAGS (default: default=)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--small", type=int, default=5, help="8-token requests of the small caller, one after another")
    ap.add_argument("--warm-s", type=float, default=3.0, help="after every flood call's first token")
    ap.add_argument("--json", default="flood_latency.json")
    args = ap.parse_args()
    variants = args.variant or [Variant("default")]
    rows = []
    for round_number in range(args.rounds):
        for variant in variants:
            with tempfile.TemporaryDirectory() as tmp:
                row = asyncio.run(one_variant(variant, args, Path(tmp)))
            rows.append({"round": round_number, **row})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'round':>5} {'variant':<16} {'small s (each)':<40} {'max':>6} {'median':>7} {'flood tok/s':>12} load")
    for r in rows:
        each = ", ".join(f"{s:.2f}" for s in r["small_s"])
        print(
            f"{r['round']:>5} {r['variant']:<16} {each:<40} {max(r['small_s']):>6.2f} "
            f"{statistics.median(r['small_s']):>7.2f} {r['flood_tok_s']:>12.0f} {r['load']}"
        )
    Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
