"""What the gateway costs per streamed token: the real gateway process in front of fake prefill and decode
services (tests/gateway_fakes.py, loaded by path: instant prefill, one token per request every --step-ms), loaded
by `splitserve bench serve` over gRPC or the REST shim (SSE). Reports the gateway's CPU time per output token
(from /proc, so it holds on a busy machine), the fakes' CPU, and what the client saw (ITL p50/p99 against the
fixed step, TPOT).

    python benchmarks/gateway_cost.py --rate 20 --num-requests 200 --output-len 256 --json out.json

One core at C us/token streams at most 1e6/C tokens/s: the rate at which the gateway, not the GPUs, sets
the inter-token latency. The ceiling itself: every request at once (`--rate inf`), a fast fake step, and the
gateway's processes side by side in one run (`--api-server-count 1,2 --rounds 2`: alternating runs); each row
reports the output tokens/s the client got, the gateway's CPU (all its processes) and the share of the
machine's cores other programs used meanwhile (host_load.py), the requests the client lost (not completed)
and the requests it sent again, by the error that ended the earlier send (a reused connection that ended
before the answer: RemoteProtocolError for the gateway's clean close, ReadError for a reset).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from splitserve.bench.serve_launch import free_port

REPO = Path(__file__).resolve().parent.parent
FAKES = REPO / "tests" / "gateway_fakes.py"
# Child processes run the installed package; PYTHONSAFEPATH keeps the cwd (a checkout's top-level folders have
# generic names: kernels/, engine/, common/, tests/) off their sys.path.
CHILD_ENV = {**os.environ, "PYTHONSAFEPATH": "1"}


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load_fakes():
    """tests/gateway_fakes.py as a module of its own name (the repository's tests/ is not a package on sys.path)."""
    name = "splitserve_gateway_fakes"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, FAKES)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def run_fakes(step_s: float, tokenizer_dir: str) -> None:
    """--role fakes: a fake prefill and a fake decode on loopback; prints their addresses, runs until killed.
    Not tests/gateway_fakes.py's own `prefill|decode PORT NAME` entry: that serves one fake with its defaults
    (a 64-token context, a 10 ms step), too short for this load and without --step-ms."""
    fakes = load_fakes()

    async def serve() -> None:
        prefill = fakes.FakeServer(fakes.FakePrefill("prefill-0", max_model_len=8192))
        decode = fakes.FakeServer(fakes.FakeDecode("decode-0", max_model_len=8192, step_s=step_s, free_blocks=1 << 20))
        await prefill.start()
        await decode.start()
        print(prefill.address, decode.address, flush=True)
        await asyncio.Event().wait()

    fakes.make_tokenizer_dir(tokenizer_dir)
    asyncio.run(serve())


def wait_ready(http_port: int, timeout_s: float = 60.0) -> None:
    """Until the gateway's /ready says a full path (prefill and decode up) exists."""
    import urllib.request

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the gateway was not ready after {timeout_s:g} s")


def measure(args, api_server_count: int, others) -> dict:
    from host_load import tree_cpu_s  # beside this script; not importable in its --role fakes child (PYTHONSAFEPATH)

    me = [sys.executable, str(Path(__file__).with_name("gateway_cost.py"))]
    with tempfile.TemporaryDirectory() as tmp:
        tok = os.path.join(tmp, "tokenizer")
        fakes = subprocess.Popen(
            me + ["--role", "fakes", "--step-ms", str(args.step_ms), "--tokenizer-dir", tok],
            env=CHILD_ENV,
            stdout=subprocess.PIPE,
            text=True,
        )
        gateway = None
        try:
            prefill, decode = fakes.stdout.readline().split()
            grpc_port, http_port = free_port(), free_port()
            gateway = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "splitserve.cli",
                    "gateway",
                    "--grpc-port",
                    str(grpc_port),
                    "--http-port",
                    str(http_port),
                    "--prefill",
                    prefill,
                    "--decode",
                    decode,
                    "--model",
                    tok,
                    "--stream-interval",
                    str(args.stream_interval),
                    "--api-server-count",
                    str(api_server_count),
                    *args.gateway_args.split(),
                ],
                env=CHILD_ENV,
                stdout=subprocess.DEVNULL,
                stderr=open(os.path.join(tmp, "gateway.log"), "w"),
            )
            wait_ready(http_port)
            out_json = os.path.join(tmp, "serve.json")

            def load(rate: float, num_requests: int) -> None:
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "splitserve.bench.serve",
                        "--api",
                        args.api,
                        "--grpc-port",
                        str(grpc_port),
                        "--http-port",
                        str(http_port),
                        "--request-rate",
                        str(rate),
                        "--num-requests",
                        str(num_requests),
                        "--input-len",
                        "32",
                        "--output-len",
                        str(args.output_len),
                        "--vocab-size",
                        "200",
                        "--slo-ttft-ms",
                        "1000",
                        "--slo-itl-ms",
                        str(3 * args.step_ms),
                        "--num-warmup",
                        "0",
                        "--no-progress",
                        "--json",
                        out_json,
                        *args.load_args.split(),
                    ],
                    env=CHILD_ENV,
                    check=True,
                    stdout=subprocess.DEVNULL,
                )

            load(50.0, 10 * api_server_count)  # warm-up (every process sees both instances up), not measured
            seen: dict[int, float] = {}  # the gateway's processes (a supervisor and its gateway processes)
            t0, g0, f0 = time.time(), tree_cpu_s(gateway.pid, seen), cpu_s(fakes.pid)
            load(args.rate, args.num_requests)
            t1, g1, f1 = time.time(), tree_cpu_s(gateway.pid, seen), cpu_s(fakes.pid)
            summary = json.loads(Path(out_json).read_text())["runs"][0]["summary"]
            if summary["num_completed"] != args.num_requests:  # counted as lost, the run goes on
                log = Path(tmp, "gateway.log").read_text().splitlines()
                log = [line for line in log if " INFO " not in line or "status=200" not in line]
                print(
                    f"only {summary['num_completed']} of {args.num_requests} requests completed: {summary['errors']}; "
                    "the gateway's log but its INFO lines of answered requests:\n" + "\n".join(log[-40:]),
                    file=sys.stderr,
                )
        finally:
            for proc in (gateway, fakes):
                if proc is not None:
                    proc.kill()
                    proc.wait()
    tokens = summary["output_tokens_received"]
    return {
        "api": args.api,
        "rate": args.rate,
        "num_requests": args.num_requests,
        "output_len": args.output_len,
        "step_ms": args.step_ms,
        "stream_interval": args.stream_interval,
        "api_server_count": api_server_count,
        "tokens": tokens,
        "lost": args.num_requests - summary["num_completed"],
        "errors": summary["errors"],
        "resent": summary.get("resent", {}),
        "output_tokens_per_s": summary["output_token_throughput"],
        "others_share": others.share(t0, t1),
        "gateway_cpu_s": g1 - g0,
        "fakes_cpu_s": f1 - f0,
        "gateway_us_per_token": (g1 - g0) / tokens * 1e6,
        "itl_ms": summary["itl_ms"],
        "tpot_ms": summary["tpot_ms"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second (Poisson; inf: all at once)")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=15.0, help="the fake decode's step")
    ap.add_argument("--api", choices=("grpc", "rest"), default="grpc", help="the gateway API the client streams from")
    ap.add_argument("--stream-interval", type=int, default=1, help="the gateway's --stream-interval")
    ap.add_argument("--api-server-count", default="1", help="the gateway's --api-server-count; several: 1,2")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each --api-server-count, alternating")
    ap.add_argument("--gateway-args", default="", help="more flags for the gateway, e.g. '--http-keep-alive-s 60'")
    ap.add_argument(
        "--load-args",
        default="",
        help="more flags for the load generator (splitserve bench serve), e.g. '--concurrency 64 --output-dist "
        "uniform --output-spread 0.9': a closed loop of mixed lengths reuses connections",
    )
    ap.add_argument("--json", default="")
    ap.add_argument("--role", default="", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "fakes":
        return run_fakes(args.step_ms / 1000, args.tokenizer_dir)
    counts = [int(c) for c in args.api_server_count.split(",")]
    print(
        f"{args.api}: {args.num_requests} requests x {args.output_len} tokens, {args.rate:g} req/s, "
        f"fake decode step {args.step_ms:g} ms, stream interval {args.stream_interval}"
    )
    print(
        f"{'processes':>9} {'output tok/s':>12} {'gw CPU s':>9} {'gw CPU us/tok':>13} {'fakes CPU s':>11} "
        f"{'ITL p50 ms':>10} {'ITL p99 ms':>10} {'TPOT p50':>9} {'others':>7} {'lost':>5}  sent again"
    )
    from host_load import OthersLoad

    results = []
    with OthersLoad() as others:
        for _ in range(args.rounds):
            for count in counts:
                r = measure(args, count, others)
                results.append(r)
                print(
                    f"{count:>9} {r['output_tokens_per_s']:>12.0f} {r['gateway_cpu_s']:>9.2f} "
                    f"{r['gateway_us_per_token']:>13.1f} {r['fakes_cpu_s']:>11.2f} {r['itl_ms']['p50']:>10.1f} "
                    f"{r['itl_ms']['p99']:>10.1f} {r['tpot_ms']['p50']:>9.1f} {r['others_share']:>7.0%} "
                    f"{r['lost']:>5}  {r['resent'] or '-'}",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
