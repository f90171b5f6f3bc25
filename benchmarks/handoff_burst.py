"""The hand-off under a burst: many prompts sent to one prefill at once, each handed to the decode the moment
its prefill answers. Per request: the prefill's answer → the decode's first delta (the request's second token),
which includes the pull and whatever the decode waits for before the request joins a step.

    python benchmarks/handoff_burst.py --device cpu --transport shm --num-requests 64 --json out.json
    python benchmarks/handoff_burst.py --device cuda:0 --transport cuda_ipc \\
        --config benchmarks/configs/qwen3-0.6b.json --dtype bfloat16 --num-requests 512 --prompt-len 1024

A prefill and a decode start as separate processes (one device, or the CPU). The table gives p50/p99/max of
the hand-off, the pulls the decode recomputed, and the leases the prefill released and let expire.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import grpc
from disagg_handoff import engine_flags, start, stop
from pull_stall import commit, percentile

from splitserve.bench.serve_launch import free_port


async def burst(args, p_addr: str, d_addr: str) -> dict:
    from splitserve.protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

    rng = random.Random(0)
    p_stub = prefill_pb2_grpc.PrefillStub(grpc.aio.insecure_channel(p_addr))
    d_stub = decode_pb2_grpc.DecodeStub(grpc.aio.insecure_channel(d_addr))
    inbox: asyncio.Queue = asyncio.Queue()

    async def requests():
        while (item := await inbox.get()) is not None:
            yield item

    call = d_stub.Generate(requests())
    first_delta: dict[str, asyncio.Future] = {}
    finished: dict[str, asyncio.Event] = {}
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    async def read():
        async for out in call:
            for delta in out.deltas:
                if not first_delta[delta.request_id].done():
                    first_delta[delta.request_id].set_result(time.perf_counter())
                if delta.finish_reason:
                    finished[delta.request_id].set()

    async def one(i: int) -> float:
        rid = f"burst-{i}"
        prompt = [rng.randrange(10, args.vocab) for _ in range(args.prompt_len)]
        first_delta[rid], finished[rid] = asyncio.get_running_loop().create_future(), asyncio.Event()
        first = await p_stub.Prefill(
            prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling, seed=i), timeout=600
        )
        answered = time.perf_counter()
        request = decode_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling, seed=i, first_token_id=first.first_token_id
        )
        request.kv.CopyFrom(first.kv)
        await inbox.put(decode_pb2.DecodeIn(request=request))
        handoff = await asyncio.wait_for(first_delta[rid], 600) - answered
        await asyncio.wait_for(finished[rid].wait(), 600)
        return handoff

    reader = asyncio.create_task(read())
    started = time.perf_counter()
    handoffs = await asyncio.gather(*(one(i) for i in range(args.num_requests)))
    wall = time.perf_counter() - started
    await inbox.put(None)
    reader.cancel()
    await asyncio.sleep(1.0)  # releases sent after the commits reach the prefill
    d = (await d_stub.Describe(common_pb2.DescribeRequest())).counters
    p = (await p_stub.Describe(common_pb2.DescribeRequest())).counters
    return {
        "requests": args.num_requests,
        "wall_s": wall,
        "handoff_p50_ms": 1e3 * percentile(handoffs, 50),
        "handoff_p99_ms": 1e3 * percentile(handoffs, 99),
        "handoff_max_ms": 1e3 * max(handoffs),
        "recomputed": d.get("kv_pull_recomputes", 0),
        "leases_released": p.get("leases_released", 0),
        "leases_expired": p.get("leases_expired", 0),
    }


def run(args, logs: Path) -> dict:
    engine = ["--device", args.device, *engine_flags(args, max_num_seqs=args.max_num_seqs)]
    if args.config:
        engine += ["--model", args.config, "--load-format", "dummy"]
    p_port, d_port = free_port(), free_port()
    prefill = decode = None
    try:
        prefill = start(
            "prefill",
            engine + ["--port", str(p_port), "--kv-transport", args.transport],
            logs / f"prefill-{args.transport}.log",
        )
        peers = ["--prefill-peers", f"127.0.0.1:{p_port}"]
        decode = start(
            "decode",
            engine + ["--port", str(d_port), "--kv-transport", args.transport, *peers],
            logs / f"decode-{args.transport}.log",
        )
        return asyncio.run(burst(args, f"127.0.0.1:{p_port}", f"127.0.0.1:{d_port}"))
    finally:
        for proc in (decode, prefill):
            if proc is not None:
                stop(proc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="device of both processes (cpu, cuda:0)")
    ap.add_argument("--transport", default="shm", choices=("shm", "cuda_ipc", "nccl"))
    ap.add_argument("--config", default=str(Path(__file__).resolve().parent / "configs" / "llama-tiny-cpu.json"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    ap.add_argument("--vocab", type=int, default=8000, help="token ids are drawn below this")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--num-kv-blocks", type=int, default=8192)
    ap.add_argument("--logs", default="/tmp/handoff-burst-logs")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    row = {"transport": args.transport, "device": args.device, **run(args, logs)}
    print(
        f"{'transport':10} {'requests':>8} {'wall s':>7} {'handoff p50 ms':>14} {'p99 ms':>8} {'max ms':>8} "
        f"{'recomputed':>10} {'released':>8} {'expired':>7}"
    )
    print(
        f"{row['transport']:10} {row['requests']:8d} {row['wall_s']:7.2f} {row['handoff_p50_ms']:14.1f} "
        f"{row['handoff_p99_ms']:8.1f} {row['handoff_max_ms']:8.1f} {row['recomputed']:10d} "
        f"{row['leases_released']:8d} {row['leases_expired']:7d}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"commit": commit(), "args": vars(args), "rows": [row]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
