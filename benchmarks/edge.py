"""The serving edge in one run: the served stack in each setup (colocated worker;
prefill + decode on the same device over a KV transport) and each API (gRPC, REST) at each in-flight count,
on the same requests, then the offline engine; every served row as a ratio of the offline engine's output tokens/s.

    python benchmarks/dummy_model_dir.py benchmarks/configs/qwen3-0.6b.json /tmp/q06
    python benchmarks/edge.py --model /tmp/q06 --device cuda:0 --kv-transport cuda_ipc --json edge.json

Every run draws prompts of the same lengths (uniform around --input-len / --output-len, seeded) with fresh token
ids, and prefix caching is off everywhere, so no run reuses another's KV. Columns: output tok/s and its ratio to
the offline engine, TTFT p50 / p99, inter-token gap p99 and max (the longest wait of any stream), TPOT p99, and
(served) the gateway's CPU seconds per second of the run (a gateway at 1.0 is saturated: one asyncio loop) and the
load generator's (this process: at 1.0 the client, not the stack, sets the pace). Where the long gaps are: the
gaps over 250 ms, the streams they hit and the half-second windows with the most of them; the client's longest
garbage-collector pause; and the gaps over 300 ms as the streaming engine's service, the gateway and the client
each saw them (their /metrics histograms), so a gap that first appears downstream is not the engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import time
import urllib.request
from pathlib import Path

from splitserve.bench.serve import Target, build_parser
from splitserve.bench.serve_launch import LaunchedStack, LaunchPlan, free_port
from splitserve.bench.serve_load import LengthDist, Progress, arrival_times, make_workload, run_load
from splitserve.bench.serve_stats import Slo, describe, summarize

KV_MEMORY = 0.85  # of the device, for the KV caches of the engines on it


def cpu_s(pid: int, seen: dict[int, float]) -> float:
    """User + system CPU seconds so far of a process and its descendants (a gateway with --api-server-count N
    is a supervisor and N gateway processes)."""
    from host_load import tree_cpu_s  # beside this script

    return tree_cpu_s(pid, seen)


class GcPauses:
    """The longest pause of this process's cyclic garbage collector while installed: a client pause shows as a gap
    in every stream at once."""

    def __init__(self) -> None:
        self.max_s = self._began = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        self.max_s = max(self.max_s, time.perf_counter() - self._began)

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def large_gaps(records, threshold_s: float = 0.25, bin_s: float = 0.5) -> dict:
    """Where the inter-token gaps above `threshold_s` fell: how many, in how many streams, at which token index
    (0: the first gap, the hand-off in a disaggregated stack), and the run's busiest `bin_s` windows by when the
    gap ended (seconds since the run's start; many streams in one window is a stall of something they share)."""
    found = []  # (ended at s, gap s, stream, token index)
    for r in records:
        if r.sent_s is None or r.ttft_s is None:
            continue
        at = r.sent_s + r.ttft_s
        for i, gap in enumerate(r.itl_s):
            at += gap
            if gap > threshold_s:
                found.append((at, gap, r.index, i))
    bins: dict[int, list] = {}
    for at, gap, stream, _ in found:
        bins.setdefault(int(at // bin_s), []).append((gap, stream))
    windows = sorted(bins.items(), key=lambda kv: -len({s for _, s in kv[1]}))[:3]
    return {
        "count": len(found),
        "streams": len({f[2] for f in found}),
        "first_gaps": sum(1 for f in found if f[3] == 0),
        "windows": [
            {"at_s": k * bin_s, "streams": len({s for _, s in v}), "max_ms": 1000 * max(g for g, _ in v)}
            for k, v in windows
        ],
    }


def lengths(args) -> tuple[LengthDist, LengthDist]:
    return (
        LengthDist("uniform", args.input_len, args.spread),
        LengthDist("uniform", args.output_len, args.spread),
    )


def offline(args) -> dict:
    """The engine in this process on the same requests (salt 0's lengths), all submitted at once."""
    from splitserve.engine import LLM, SamplingParams

    prompts, outputs = lengths(args)
    specs = make_workload(args.num_requests, prompts, outputs, args.vocab_size, args.max_model_len, args.seed)
    llm = LLM(args.model, load_format="dummy", enable_prefix_caching=False, **engine_kwargs(args))
    try:
        warm = make_workload(16, prompts, outputs, args.vocab_size, args.max_model_len, args.seed + 7919)
        llm.generate(
            prompt_token_ids=[s.prompt for s in warm],
            sampling_params=[SamplingParams(max_tokens=s.output_len, ignore_eos=True, temperature=0) for s in warm],
        )
        start = time.perf_counter()
        outs = llm.generate(
            prompt_token_ids=[s.prompt for s in specs],
            sampling_params=[SamplingParams(max_tokens=s.output_len, ignore_eos=True, temperature=0) for s in specs],
        )
        seconds = time.perf_counter() - start
    finally:
        llm.close()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"setup": "offline", "api": "-", "in_flight": args.num_requests, "output_tok_s": tokens / seconds}


def engine_kwargs(args) -> dict:
    kwargs = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    return kwargs | ({"device": args.device} if args.device else {})


def engine_flags(args) -> str:
    flags = f"--model {args.model} --load-format dummy --no-enable-prefix-caching"
    return flags + (f" --max-model-len {args.max_model_len}" if args.max_model_len else "") + f" {args.engine_args}"


def _target_ns(api: str, vocab_size: int):
    return build_parser().parse_args(
        ["--api", api, "--no-progress", "--num-warmup", "16", "--vocab-size", str(vocab_size)]
    )


async def served_run(args, stack: LaunchedStack, api: str, in_flight: int, salt: int) -> tuple[dict, list]:
    """One load of --num-requests against the running stack through `api`, `in_flight` at a time, from this
    process or from --client-processes processes, each with its share of the requests and of `in_flight`:
    (its row, the records)."""
    ns = _target_ns(api, args.vocab_size)
    prompts, outputs = lengths(args)
    async with Target(ns, "127.0.0.1", stack.grpc_port, stack.http_port) as target:
        warm = make_workload(16, prompts, outputs, args.vocab_size, target.max_model_len, args.seed + 7919, salt)
        await run_load(
            warm,
            arrival_times(16, float("inf"), 0),
            target.send,
            concurrency=16,
            max_seconds=600,
            progress=Progress(16, "warm-up", enabled=False),
        )
        specs = make_workload(
            args.num_requests, prompts, outputs, args.vocab_size, target.max_model_len, args.seed, salt
        )
        gateway = stack.procs["gateway"].pid
        seen: dict[int, float] = {}
        cpu0 = cpu_s(gateway, seen)
        if args.client_processes > 1:
            ports = (stack.grpc_port, stack.http_port)
            records, duration, client_cpu, client_gc_max_s = await asyncio.to_thread(
                _load_in_processes, api, args.vocab_size, ports, specs, in_flight, args.client_processes
            )
        else:  # on the warmed connections
            client0 = time.process_time()
            with GcPauses() as pauses:
                records, duration = await _run_share(target, api, specs, in_flight)
            client_cpu, client_gc_max_s = time.process_time() - client0, pauses.max_s
        gateway_cpu = cpu_s(gateway, seen) - cpu0  # per second of the load, not of the client processes' start
    summary = summarize(records, duration, Slo(None, None, None))
    if summary["num_completed"] != len(specs):
        raise RuntimeError(
            f"{api} x{in_flight}: {summary['num_completed']} of {len(specs)} completed: {summary['errors']}"
        )
    return {
        "api": api,
        "in_flight": in_flight,
        "output_tok_s": summary["output_token_throughput"],
        "ttft_ms": summary["ttft_ms"],
        "itl_ms": summary["itl_ms"],
        "tpot_ms": summary["tpot_ms"],
        "gateway_cpu_per_s": gateway_cpu / duration,
        # the load generator's processes: at 1.0 a process, the client, not the stack, sets the pace
        "client_cpu_per_s": client_cpu / duration,
        "client_processes": args.client_processes,
        "client_gc_max_ms": 1000 * client_gc_max_s,
        # the hand-off shows in the gap after a stream's first token (from the prefill in a disaggregated stack)
        "first_gap_ms": describe([r.itl_s[0] for r in records if r.itl_s]),
        "later_gap_max_ms": 1000 * max((x for r in records for x in r.itl_s[1:]), default=0.0),
        "gaps_over_250ms": large_gaps(records),
    }, records


async def _run_share(target: Target, api: str, specs, in_flight: int):
    """Send `specs`, all at once, `in_flight` at a time: (records, duration)."""
    return await run_load(
        specs,
        arrival_times(len(specs), float("inf"), 0),
        target.send,
        concurrency=in_flight,
        max_seconds=600,
        progress=Progress(len(specs), f"{api} x{in_flight}", enabled=False),
    )


async def _load_share(api: str, vocab_size: int, ports: tuple[int, int], specs, in_flight: int):
    """A client process's share, once every process has connected (the barrier): (records, start, duration)."""
    async with Target(_target_ns(api, vocab_size), "127.0.0.1", *ports) as target:
        _barrier.wait(300)
        start = time.time()
        records, duration = await _run_share(target, api, specs, in_flight)
    return records, start, duration


_barrier = None  # a client process's start barrier (set by its pool's initializer)


def _set_barrier(barrier) -> None:
    global _barrier
    _barrier = barrier


def _client_process(api: str, vocab_size: int, ports: tuple[int, int], specs, in_flight: int):
    """One load-generator process's share: (records, start, end as time.time(), its CPU seconds, its longest
    garbage-collector pause)."""
    cpu0 = time.process_time()
    with GcPauses() as pauses:
        records, start, duration = asyncio.run(_load_share(api, vocab_size, ports, specs, in_flight))
    return records, start, start + duration, time.process_time() - cpu0, pauses.max_s


def _load_in_processes(api: str, vocab_size: int, ports: tuple[int, int], specs, in_flight: int, n: int):
    """The load split over `n` spawned processes (every n-th request, in_flight shared out); the duration runs
    from the first share's start to the last one's end. Returns (records, duration, their CPU seconds, the
    longest garbage-collector pause of any of them). Each share's times are relative to its own start."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(n)
    flights = [in_flight // n + (i < in_flight % n) for i in range(n)]
    with ProcessPoolExecutor(n, mp_context=ctx, initializer=_set_barrier, initargs=(barrier,)) as pool:
        futures = [pool.submit(_client_process, api, vocab_size, ports, specs[i::n], flights[i]) for i in range(n)]
        shares = [f.result() for f in futures]
    records = [r for share in shares for r in share[0]]
    duration = max(s[2] for s in shares) - min(s[1] for s in shares)
    return records, duration, sum(s[3] for s in shares), max(s[4] for s in shares)


SLOW_S = 0.3  # a bucket bound of both the decode's and the gateway's inter-token histograms
DECODE_ITL, GATEWAY_ITL = "vllm:inter_token_latency_seconds", "splitserve:gateway_inter_token_latency_seconds"


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def preemptions(text: str) -> int:
    """The streaming engine's preemptions so far (its /metrics text)."""
    prefix = "splitserve:num_preemptions_total"
    return sum(int(float(line.split()[-1])) for line in text.splitlines() if line.startswith(prefix))


def slower_than(text: str, family: str, bound_s: float = SLOW_S) -> int:
    """How many observations of histogram `family` (summed over its label sets) exceeded `bound_s`, one of its
    bucket bounds: the count less the bucket at that bound."""
    total = below = 0.0
    le = f'le="{bound_s}"'
    for line in text.splitlines():
        if line.startswith(f"{family}_count"):
            total += float(line.split()[-1])
        elif line.startswith(f"{family}_bucket") and le in line:
            below += float(line.split()[-1])
    return int(total - below)


def where_slow(engine_before: str, engine_after: str, gateway_before: str, gateway_after: str, records) -> dict:
    """Inter-token gaps over SLOW_S counted at each hop of a token: as the streaming engine's service saw its
    engine's outputs (for an imported request its first gap runs from the prefill's token arriving there), as
    the gateway sent them, and as the client read them. A gap the engine's service already saw came from the
    engine or its core; one that appears first at the gateway or the client was made downstream."""
    return {
        "engine_service": slower_than(engine_after, DECODE_ITL) - slower_than(engine_before, DECODE_ITL),
        "gateway": slower_than(gateway_after, GATEWAY_ITL) - slower_than(gateway_before, GATEWAY_ITL),
        "client": sum(1 for r in records for x in r.itl_s if x > SLOW_S),
    }


def served(args, setup: str) -> list[dict]:
    num_engines = 2 if setup == "disaggregated" else 1
    devices = "" if not args.device else ",".join([args.device] * num_engines)
    metrics_port = free_port()  # the engine that streams: the worker, or the decode
    metrics = ("--metrics-port", str(metrics_port))
    if setup == "disaggregated":  # the two engines share the device's KV memory
        prefill_share, decode_share = KV_MEMORY * (1 - args.decode_kv_share), KV_MEMORY * args.decode_kv_share
        role_args = (
            ("prefill", ("--kv-cache-memory-fraction", f"{prefill_share:.3f}")),
            ("decode", ("--kv-cache-memory-fraction", f"{decode_share:.3f}", *metrics)),
        )
    else:
        role_args = (("worker", ("--kv-cache-memory-fraction", f"{KV_MEMORY}", *metrics)),)
    plan = LaunchPlan.from_strings(
        setup, engine_flags(args), args.gateway_args, devices, num_workers=1, kv_transport=args.kv_transport
    )
    plan = dataclasses.replace(plan, role_args=role_args)
    rows, salt = [], 1
    with LaunchedStack(plan, os.path.join(args.log_dir, setup) if args.log_dir else None) as stack:
        print(f"{setup} ready in {stack.ready_s:.1f} s (logs in {stack.log_dir})", flush=True)
        for in_flight in args.in_flight:
            for api in args.apis:
                engine0, gateway0 = scrape(metrics_port), scrape(stack.http_port)
                row, records = asyncio.run(served_run(args, stack, api, in_flight, salt))
                engine1, gateway1 = scrape(metrics_port), scrape(stack.http_port)
                row["preemptions"] = preemptions(engine1) - preemptions(engine0)
                row["gaps_over_300ms_at"] = where_slow(engine0, engine1, gateway0, gateway1, records)
                rows.append({"setup": setup, **row})
                print(json.dumps(rows[-1]), flush=True)
                salt += 1
    return rows


def table(rows: list[dict], offline_tok_s: float | None) -> str:
    head = f"{'setup':<14} {'api':<5} {'in flight':>9} {'out tok/s':>10} {'x offline':>9} {'TTFT p50/p99 ms':>16} "
    head += (
        f"{'ITL p99/max ms':>15} {'TPOT p99':>9} {'gw CPU/s':>9} {'client CPU/s':>12} {'preempted':>9} "
        f"{'1st gap max':>11} {'later max':>9} {'>250ms n/streams':>16} {'client GC max':>13} "
        f"{'>300ms engine/gw/client':>23}"
    )
    lines = [head]
    for r in rows:
        ratio = f"{r['output_tok_s'] / offline_tok_s:.2f}" if offline_tok_s else "-"
        if r["setup"] == "offline":
            lines.append(f"{'offline':<14} {'-':<5} {r['in_flight']:>9} {r['output_tok_s']:>10,.0f} {ratio:>9}")
            continue
        ttft = f"{r['ttft_ms']['p50']:.0f}/{r['ttft_ms']['p99']:.0f}"
        itl = f"{r['itl_ms']['p99']:.1f}/{r['itl_ms']['max']:.0f}"
        lines.append(
            f"{r['setup']:<14} {r['api']:<5} {r['in_flight']:>9} {r['output_tok_s']:>10,.0f} {ratio:>9} {ttft:>16} "
            f"{itl:>15} {r['tpot_ms']['p99']:>9.1f} {r['gateway_cpu_per_s']:>9.2f} {r['client_cpu_per_s']:>12.2f} "
            f"{r['preemptions']:>9} "
            f"{r['first_gap_ms']['max']:>11.0f} {r['later_gap_max_ms']:>9.0f} "
            f"{r['gaps_over_250ms']['count']:>7}/{r['gaps_over_250ms']['streams']:<8} {r['client_gc_max_ms']:>13.1f} "
            f"{'/'.join(str(v) for v in r['gaps_over_300ms_at'].values()):>23}"
        )
    for r in rows:  # where the long gaps fell: many streams in one window is a stall of something they share
        if r["setup"] != "offline" and r["gaps_over_250ms"]["count"]:
            where = ", ".join(
                f"{w['streams']} streams at {w['at_s']:.1f} s (max {w['max_ms']:.0f} ms)"
                for w in r["gaps_over_250ms"]["windows"]
            )
            first = r["gaps_over_250ms"]["first_gaps"]
            lines.append(f"{r['setup']} {r['api']} x{r['in_flight']}: gaps > 250 ms ({first} first gaps): {where}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model directory (benchmarks/dummy_model_dir.py); dummy weights")
    ap.add_argument("--device", default="", help="every engine process's device (default: the engine's)")
    ap.add_argument("--setups", default="colocated,disaggregated")
    ap.add_argument("--apis", default="grpc,rest")
    ap.add_argument("--in-flight", default="256,64", help="comma list of concurrencies")
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--spread", type=float, default=0.9, help="uniform lengths in len * [1 - spread, 1 + spread]")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-transport", default="shm", choices=("shm", "cuda_ipc", "nccl"))
    ap.add_argument("--decode-kv-share", type=float, default=0.5, help="disaggregated: the decode's share of KV memory")
    ap.add_argument("--engine-args", default="", help="more engine flags for every engine process")
    ap.add_argument("--gateway-args", default="")
    ap.add_argument(
        "--client-processes", type=int, default=1, help="load-generator processes (one at 1.0 CPU s/s sets the pace)"
    )
    ap.add_argument("--no-offline", action="store_true")
    ap.add_argument("--log-dir", default="")
    ap.add_argument("--json", default="", help="write the rows here (default: $OUT/edge.json when $OUT is set)")
    args = ap.parse_args()
    args.apis = [a for a in args.apis.split(",") if a]
    args.in_flight = [int(c) for c in args.in_flight.split(",") if c]
    rows = []
    for setup in [s for s in args.setups.split(",") if s]:
        rows += served(args, setup)
    if not args.no_offline:  # last: the stacks' processes are gone, and this one keeps what its engine cached
        rows.insert(0, offline(args))
        print(json.dumps(rows[0]), flush=True)
    print(table(rows, None if args.no_offline else rows[0]["output_tok_s"]))
    out = args.json or (os.path.join(os.environ["OUT"], "edge.json") if os.environ.get("OUT") else "")
    if out:
        Path(out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
