"""Does a KV pull stall the decode's other streams? Running requests' inter-token latency while pulls of
long prompts arrive, against the same decode with no arrivals.

    python benchmarks/pull_stall.py --transports cuda_ipc --device cuda:0 \\
        --config benchmarks/configs/qwen3-0.6b.json --rates 0,2,8 --json out.json
                                  (one GPU: prefill and decode both on cuda:0)
    python benchmarks/pull_stall.py --transports shm,nccl --device cpu \\
        --config benchmarks/configs/llama-tiny-cpu.json --num-threads 1
                                  (CPU: shm, and nccl's CPU path, gloo; a tiny model)

Per transport a prefill and a decode start as separate processes. Per arrival rate: `--num-running` requests (short
prompts, long outputs) run on the decode; `--prompt-len`-token prompts are prefilled ahead and held under
lease before the running requests start (so every rate's window begins at the same running contexts), then
handed to the decode at `rate` per second for `--duration-s` (each pulls its KV and stops after one token).
The table (printed last; `--json` keeps the rows) gives p50/p99/max of the running requests' gaps
between token deltas during that window, and p99 against the rate-0 run of the same process pair.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from disagg_handoff import engine_flags, start, stop

from splitserve.bench.serve_launch import free_port


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else float("nan")


async def one_rate(args, rate: float, p_addr: str, d_addr: str, seed: int) -> dict:
    from splitserve.protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

    rng = random.Random(seed)
    p_stub = prefill_pb2_grpc.PrefillStub(grpc.aio.insecure_channel(p_addr))
    d_stub = decode_pb2_grpc.DecodeStub(grpc.aio.insecure_channel(d_addr))
    inbox: asyncio.Queue = asyncio.Queue()

    async def requests():
        while (item := await inbox.get()) is not None:
            yield item

    call = d_stub.Generate(requests())
    arrivals: dict[str, list[float]] = {}
    finished: dict[str, asyncio.Event] = {}

    async def read():
        async for out in call:
            now = time.perf_counter()
            for delta in out.deltas:
                if delta.token_ids:
                    arrivals.setdefault(delta.request_id, []).append(now)
                if delta.finish_reason and delta.request_id in finished:
                    finished[delta.request_id].set()

    reader = asyncio.create_task(read())

    async def prefill(rid: str, length: int, max_tokens: int):
        prompt = [rng.randrange(10, args.vocab) for _ in range(length)]
        sampling = common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        first = await p_stub.Prefill(
            prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling, seed=1), timeout=600
        )
        return decode_pb2.DecodeIn(
            request=decode_pb2.DecodeRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                sampling=sampling,
                seed=1,
                first_token_id=first.first_token_id,
                kv=first.kv,
            )
        )

    tag = f"r{rate:g}"
    running = [f"{tag}-run-{i}" for i in range(args.num_running)]
    # the pulls' prompts first: prefilled while the running requests stream, they made each rate's window start
    # at longer running contexts (40 prefills at 8/s: ~1 s more decoding, its steps read more KV) than rate 0's,
    # which showed up as a p50 shift of the whole distribution, not as stalls
    held = [await prefill(f"{tag}-pull-{i}", args.prompt_len, 1) for i in range(int(rate * args.duration_s))]
    for rid in running:
        await inbox.put(await prefill(rid, 16, args.running_tokens))
    deadline = time.monotonic() + 60
    while not all(len(arrivals.get(r, [])) >= 3 for r in running):  # every running request streams
        assert time.monotonic() < deadline, "the running requests never started streaming"
        await asyncio.sleep(0.01)
    window_start = time.perf_counter()
    for i, item in enumerate(held):
        finished[item.request.request_id] = asyncio.Event()
        target = window_start + (i + 1) / rate if rate else window_start
        await asyncio.sleep(max(0.0, target - time.perf_counter()))
        await inbox.put(item)
    await asyncio.sleep(max(0.0, window_start + args.duration_s - time.perf_counter()))
    window_end = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in finished.values())), 120)
    gaps = [
        b - a for rid in running for a, b in zip(arrivals[rid], arrivals[rid][1:]) if window_start <= b <= window_end
    ]
    for rid in running:
        await inbox.put(decode_pb2.DecodeIn(abort=decode_pb2.AbortRequest(request_id=rid)))
    await inbox.put(None)
    call.cancel()
    reader.cancel()
    return {
        "rate_per_s": rate,
        "pulls": len(held),
        "gaps": len(gaps),
        "itl_p50_ms": 1e3 * percentile(gaps, 50),
        "itl_p99_ms": 1e3 * percentile(gaps, 99),
        "itl_max_ms": 1e3 * max(gaps, default=float("nan")),
        "itl_mean_ms": 1e3 * statistics.fmean(gaps) if gaps else float("nan"),
    }


def run_transport(args, transport: str, logs: Path) -> list[dict]:
    """Start a prefill and a decode over `transport`, and measure each rate on that pair."""
    engine = ["--device", args.device, *engine_flags(args, max_num_seqs=args.num_running + 16)]
    if args.num_threads:
        engine += ["--num-threads", str(args.num_threads)]
    if args.config:
        engine += ["--model", args.config, "--load-format", "dummy"]
    p_port, d_port = free_port(), free_port()
    prefill = decode = None
    rows = []
    try:
        prefill = start(
            "prefill",
            engine + ["--port", str(p_port), "--kv-transport", transport, "--lease-s", "600"],
            logs / f"prefill-{transport}.log",
        )
        decode = start(
            "decode",
            engine + ["--port", str(d_port), "--kv-transport", transport, "--prefill-peers", f"127.0.0.1:{p_port}"],
            logs / f"decode-{transport}.log",
        )
        for i, rate in enumerate(float(r) for r in args.rates.split(",")):
            row = asyncio.run(one_rate(args, rate, f"127.0.0.1:{p_port}", f"127.0.0.1:{d_port}", i))
            rows.append({"transport": transport_label(transport, args.device), **row})
    finally:
        for proc in (decode, prefill):
            if proc is not None:
                stop(proc)
    return rows


def transport_label(transport: str, device: str) -> str:
    return "gloo" if transport == "nccl" and device == "cpu" else transport  # the nccl transport runs gloo on CPU


def commit() -> str:
    """The checkout's commit (+ "-dirty" with uncommitted changes), or "" outside a git checkout."""
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=repo, capture_output=True, text=True)
    except OSError:
        return ""
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--transports", default="shm", help="comma-separated, of shm, cuda_ipc, nccl (gloo on CPU); one pair each"
    )
    ap.add_argument("--device", default="cpu", help="device of both processes (cpu, cuda:0)")
    ap.add_argument("--config", default="", help="model config.json (dummy weights); empty = the embedded model")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"), help="both services'")
    ap.add_argument("--vocab", type=int, default=8000, help="token ids are drawn below this")
    ap.add_argument("--rates", default="0,2,8", help="pull arrivals per second, comma-separated")
    ap.add_argument("--num-running", type=int, default=32)
    ap.add_argument("--running-tokens", type=int, default=4000, help="max_tokens of the running requests")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--duration-s", type=float, default=5.0)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--num-kv-blocks", type=int, default=16384)
    ap.add_argument(
        "--num-threads",
        type=int,
        default=0,
        help="torch CPU threads of each engine (0: torch's default); CPU runs: 1, so that the prefill's and the "
        "decode's thread pools do not wait on each other's cores",
    )
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    transports = args.transports.split(",")
    unknown = sorted(set(transports) - {"shm", "cuda_ipc", "nccl"})
    if unknown:
        ap.error(f"--transports: {', '.join(unknown)} not among shm, cuda_ipc, nccl")
    logs = Path(tempfile.mkdtemp(prefix="pull-stall-"))
    rows = []
    context = {"commit": commit(), "load_average_at_start": os.getloadavg()}
    for transport in transports:
        rows += run_transport(args, transport, logs)
        if args.json:
            context["load_average_now"] = os.getloadavg()  # other work on the machine moves every ITL
            Path(args.json).write_text(json.dumps({"args": vars(args), **context, "rows": rows}, indent=2))
    print(
        f"\npull stall on {args.device}: {args.num_running} running, {args.prompt_len}-token pulls, "
        f"{args.duration_s:g} s windows; commit {context['commit']}, load average {os.getloadavg()[0]:.1f} "
        f"(at start {context['load_average_at_start'][0]:.1f}; logs {logs})"
    )
    print(
        f"{'transport':>10}{'pulls/s':>8}{'pulls':>7}{'gaps':>7}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"
        f"{'p99/rate0':>11}"
    )
    for r in rows:
        base = next((b["itl_p99_ms"] for b in rows if b["transport"] == r["transport"] and b["rate_per_s"] == 0), None)
        ratio = f"{r['itl_p99_ms'] / base:>11.2f}" if base else f"{'-':>11}"
        print(
            f"{r['transport']:>10}{r['rate_per_s']:>8g}{r['pulls']:>7}{r['gaps']:>7}{r['itl_p50_ms']:>9.2f}"
            f"{r['itl_p99_ms']:>9.2f}{r['itl_max_ms']:>9.2f}{ratio}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
