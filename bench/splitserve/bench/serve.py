"""Serving benchmark: load against the gateway (gRPC or REST), TTFT / ITL / TPOT / e2e, goodput.

    # against a running stack (`splitserve up`), 2 req/s Poisson, 100 requests
    splitserve bench serve --request-rate 2 --num-requests 100 --slo-ttft-ms 1000 --slo-itl-ms 100

    # start the stack itself, sweep rates, plot; the same seed gives the same workload in both modes
    splitserve bench serve --launch disaggregated --engine-args "--num-threads 1" \
        --sweep 1,2,4 --num-requests 30 --json disagg.json --plot-prefix disagg

Requests carry random token-id prompts (seeded) and forced output lengths (ignore_eos,
max_tokens). Targets must be loopback. `--mode` only labels the output; `--launch MODE` starts
`disaggregated` (prefill + decode) or `colocated` (workers, role both) processes behind the same
gateway code on free ports and stops them at the end. Definitions are in serve_stats.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import subprocess
import sys
import time

from splitserve.bench.serve_launch import MODES, REPO, LaunchedStack, LaunchPlan
from splitserve.bench.serve_load import (
    LENGTH_DISTS,
    LengthDist,
    Progress,
    arrival_times,
    check_loopback,
    error_message,
    grpc_sender,
    make_workload,
    rest_sender,
    run_load,
    url_host,
)
from splitserve.bench.serve_stats import Slo, summarize
from splitserve.bench.serve_table import format_run, format_sweep


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="splitserve bench serve",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    t = p.add_argument_group("target")
    t.add_argument("--api", choices=("grpc", "rest"), default="grpc", help="gateway API to load")
    t.add_argument("--host", default="127.0.0.1", help="gateway host (loopback only)")
    t.add_argument("--grpc-port", type=int, default=50051, help="gateway gRPC port")
    t.add_argument("--http-port", type=int, default=8000, help="gateway REST port")
    t.add_argument("--mode", default="", help="label for the output (disaggregated, colocated, ...)")
    t.add_argument("--request-timeout-s", type=float, default=600.0, help="per-request timeout")
    t.add_argument(
        "--grpc-connections",
        type=int,
        default=8,
        help="gRPC: HTTP/2 connections the requests take in turn (a gateway with several API-server processes "
        "spreads connections between them, not the streams of one connection)",
    )
    s = p.add_argument_group("launch (start the stack for this run)")
    s.add_argument("--launch", choices=MODES, help="start this setup on free loopback ports, stop it at the end")
    s.add_argument("--engine-args", default="", help="engine flags for every engine process, e.g. '--num-threads 1'")
    s.add_argument("--gateway-args", default="", help="extra gateway flags")
    s.add_argument("--devices", default="", help="comma list, one --device per engine process in start order")
    s.add_argument("--num-prefill", type=int, default=1, help="disaggregated: prefill processes")
    s.add_argument("--num-decode", type=int, default=1, help="disaggregated: decode processes")
    s.add_argument("--num-workers", type=int, default=2, help="colocated: worker processes")
    s.add_argument(
        "--kv-transport", default="shm", choices=("shm", "cuda_ipc", "nccl", "nixl"), help="disaggregated KV transport"
    )
    s.add_argument("--log-dir", default="", help="children's logs (default: a new temp dir)")
    s.add_argument("--ready-timeout-s", type=float, default=300.0, help="how long the stack may take to start")
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=100, help="requests per rate")
    w.add_argument("--max-seconds", type=float, default=600.0, help="per rate: stop sending and cancel after this")
    w.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals, req/s (inf: all at once)")
    w.add_argument("--concurrency", type=int, default=None, help="most requests in flight (alone: closed loop)")
    w.add_argument("--sweep", default="", help="comma list of request rates; draws curves")
    w.add_argument("--input-len", type=int, default=128, help="prompt tokens (fixed, uniform mean, longtail median)")
    w.add_argument("--input-dist", choices=LENGTH_DISTS, default="fixed", help="prompt length distribution")
    w.add_argument("--input-spread", type=float, default=0.5, help="uniform: ±ratio; longtail: lognormal sigma")
    w.add_argument("--output-len", type=int, default=64, help="forced output tokens")
    w.add_argument("--output-dist", choices=LENGTH_DISTS, default="fixed", help="output length distribution")
    w.add_argument("--output-spread", type=float, default=0.5, help="uniform: ±ratio; longtail: lognormal sigma")
    w.add_argument("--vocab-size", type=int, default=8192, help="prompt token ids are drawn from [1, vocab-size)")
    w.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    w.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    w.add_argument("--num-warmup", type=int, default=10, help="unmeasured requests sent first, at the first rate")
    o = p.add_argument_group("SLO and output")
    o.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT target")
    o.add_argument("--slo-itl-ms", type=float, default=None, help="goodput: target for the p99 of a request's ITLs")
    o.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT target")
    o.add_argument("--json", default="", help="write the results here")
    o.add_argument("--plot-prefix", default="", help="sweep: write <prefix>_latency.png and <prefix>_goodput.png")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def parse_rates(ns: argparse.Namespace) -> list[float]:
    if not ns.sweep:
        return [ns.request_rate]
    try:
        rates = [float(x) for x in ns.sweep.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sweep must be a comma list of request rates, got {ns.sweep!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--sweep rates must be > 0, got {ns.sweep!r}")
    return rates


class Target:
    """The gateway's two APIs, opened for one benchmark; `send` is the chosen API's sender."""

    def __init__(self, ns: argparse.Namespace, host: str, grpc_port: int, http_port: int) -> None:
        self.ns, self.grpc_target = ns, f"{url_host(host)}:{grpc_port}"
        self.base_url = f"http://{url_host(host)}:{http_port}"
        self.model_id, self.max_model_len = "", None
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Target:
        if self.ns.api == "grpc":
            import grpc

            from splitserve.protos import generation_pb2, generation_pb2_grpc

            # a local subchannel pool per channel: channels to one target would otherwise share one connection
            options = [("grpc.max_concurrent_streams", 1 << 16), ("grpc.use_local_subchannel_pool", 1)]
            stubs = []
            for _ in range(self.ns.grpc_connections):
                channel = await self._stack.enter_async_context(grpc.aio.insecure_channel(self.grpc_target, options))
                stubs.append(generation_pb2_grpc.GenerationStub(channel))
            try:
                models = await stubs[0].ListModels(generation_pb2.ListModelsRequest(), timeout=30)
            except grpc.aio.AioRpcError as exc:
                raise RuntimeError(
                    f"cannot reach the gateway's gRPC API at {self.grpc_target}: {error_message(exc)}"
                ) from None
            self.model_id, self.max_model_len = models.models[0].id, models.models[0].max_model_len or None
            self.send = grpc_sender(stubs, self.ns.temperature, self.ns.request_timeout_s)
        else:
            import httpx

            client = await self._stack.enter_async_context(
                httpx.AsyncClient(
                    timeout=httpx.Timeout(self.ns.request_timeout_s, connect=30),
                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                )
            )
            try:
                # on a connection of its own: one idle connection in the pool when a burst of requests starts is
                # handed to all of them, which then wait in turn on its lock, one event-loop turn each (seconds
                # at 256 requests once the loop is busy with streams), counted in their TTFT, and take up
                # connections the server is closing idle
                models = await client.get(f"{self.base_url}/v1/models", headers={"Connection": "close"})
                data = models.raise_for_status().json()["data"]
            except httpx.HTTPError as exc:
                raise RuntimeError(
                    f"cannot reach the gateway's REST API at {self.base_url}: {error_message(exc)}"
                ) from None
            self.model_id, self.max_model_len = data[0]["id"], data[0].get("max_model_len") or None
            self.send = rest_sender(client, self.base_url, self.model_id, self.ns.temperature)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._stack.aclose()


async def warm_up(
    ns: argparse.Namespace, target: Target, prompts: LengthDist, outputs: LengthDist, rate: float
) -> None:
    """--num-warmup requests of the same length distributions at the first rate, not measured: a fresh
    stack's first batches of each shape run slower. Every warm-up request must complete."""
    if ns.num_warmup == 0:
        return
    specs = make_workload(ns.num_warmup, prompts, outputs, ns.vocab_size, target.max_model_len, ns.seed + 7919)
    records, _ = await run_load(
        specs,
        arrival_times(len(specs), rate, ns.seed + 7919),
        target.send,
        concurrency=ns.concurrency,
        max_seconds=ns.request_timeout_s,
        progress=Progress(len(specs), "warm-up", enabled=not ns.no_progress),
    )
    failed = [r for r in records if r.status != "completed"]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(records)} warm-up requests failed, e.g. {failed[0].error}")


async def measure(ns: argparse.Namespace, host: str, grpc_port: int, http_port: int, rates: list[float]) -> dict:
    """Warm up, then one run per rate on the same seeded workload; the results as a JSON-able dict."""
    prompts = LengthDist(ns.input_dist, ns.input_len, ns.input_spread)
    outputs = LengthDist(ns.output_dist, ns.output_len, ns.output_spread)
    slo = Slo(ns.slo_ttft_ms, ns.slo_itl_ms, ns.slo_tpot_ms)
    async with Target(ns, host, grpc_port, http_port) as target:
        await warm_up(ns, target, prompts, outputs, rates[0])
        runs = []
        for salt, rate in enumerate(rates):  # fresh prompts per run: no prefix-cache hits from an earlier run
            specs = make_workload(ns.num_requests, prompts, outputs, ns.vocab_size, target.max_model_len, ns.seed, salt)
            label = f"rate {rate:g}" + (f", conc {ns.concurrency}" if ns.concurrency else "")
            arrivals = arrival_times(len(specs), rate, ns.seed)
            records, duration = await run_load(
                specs,
                arrivals,
                target.send,
                concurrency=ns.concurrency,
                max_seconds=ns.max_seconds,
                progress=Progress(len(specs), label, enabled=not ns.no_progress),
            )
            summary = summarize(records, duration, slo)
            runs.append(
                {
                    "request_rate": rate,
                    "concurrency": ns.concurrency,
                    "workload_salt": salt,
                    "summary": summary,
                    "requests": [r.to_json() for r in records],
                }
            )
            print(format_run(runs[-1], ns.mode or "-", ns.api), flush=True)
        return {"model_id": target.model_id, "max_model_len": target.max_model_len, "runs": runs}


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def check_args(ns: argparse.Namespace) -> list[float]:
    """The rates to run; ValueError naming the first bad option."""
    if ns.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {ns.num_requests}")
    if not ns.max_seconds > 0:
        raise ValueError(f"--max-seconds must be > 0, got {ns.max_seconds}")
    if ns.concurrency is not None and ns.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {ns.concurrency}")
    if ns.grpc_connections < 1:
        raise ValueError(f"--grpc-connections must be >= 1, got {ns.grpc_connections}")
    if ns.num_warmup < 0:
        raise ValueError(f"--num-warmup must be >= 0, got {ns.num_warmup}")
    LengthDist(ns.input_dist, ns.input_len, ns.input_spread)
    LengthDist(ns.output_dist, ns.output_len, ns.output_spread)
    if not ns.launch:
        check_loopback(ns.host)
    return parse_rates(ns)


def jsonable(value):
    """`value` with NaN and infinities as null (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def run(ns: argparse.Namespace) -> dict:
    """The whole benchmark: launch (optional), measure every rate, stop; returns the JSON result."""
    rates = check_args(ns)
    if ns.launch:
        ns.mode = ns.mode or ns.launch
    result = {
        "mode": ns.mode,
        "api": ns.api,
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%d"),
        "config": {k: v for k, v in vars(ns).items() if k not in ("json", "no_progress")},
    }
    with contextlib.ExitStack() as stack:
        host, grpc_port, http_port = ns.host, ns.grpc_port, ns.http_port
        if ns.launch:
            plan = LaunchPlan.from_strings(
                ns.launch,
                ns.engine_args,
                ns.gateway_args,
                ns.devices,
                num_prefill=ns.num_prefill,
                num_decode=ns.num_decode,
                num_workers=ns.num_workers,
                kv_transport=ns.kv_transport,
            )
            launched = stack.enter_context(LaunchedStack(plan, ns.log_dir or None, ns.ready_timeout_s))
            host, grpc_port, http_port = "127.0.0.1", launched.grpc_port, launched.http_port
            result["launch"] = {
                "num_engines": plan.num_engines,
                "ready_s": launched.ready_s,
                "log_dir": str(launched.log_dir),
            }
            print(
                f"{ns.launch} stack ready in {launched.ready_s:.1f} s (logs in {launched.log_dir})",
                file=sys.stderr,
                flush=True,
            )
        result.update(asyncio.run(measure(ns, host, grpc_port, http_port, rates)))
    if len(rates) > 1:
        print(format_sweep(result), flush=True)
        if ns.plot_prefix:
            plotted = _plot(result, ns.plot_prefix)
            result["plots"] = plotted if isinstance(plotted, list) else []
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(jsonable(result), f, indent=1, allow_nan=False)
    return result


def _plot(result: dict, prefix: str) -> list[str] | str:
    from splitserve.bench.serve_plot import plot_sweeps

    plotted = plot_sweeps([result], prefix)
    print(plotted if isinstance(plotted, str) else "plots: " + ", ".join(plotted), file=sys.stderr)
    return plotted


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        run(ns)
    except ValueError as exc:
        print(f"splitserve bench serve: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # the stack did not start, or the warm-up failed
        print(f"splitserve bench serve: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
