"""`splitserve bench NAME [ARGS...]`: run a benchmark module of this package with its own arguments."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "offline_throughput": "offline throughput vs transformers and vLLM; fixed-shape decode-step timing (GPU)",
    "kernels": "Triton kernels vs SDPA and the copy bandwidth (GPU)",
    "disagg_handoff": "prefill and decode on two devices: tokens, KV pull rate, hand-off latency",
    "serve": "load generator against the gateway: TTFT, ITL, TPOT, goodput, rate sweeps",
}


def run(ns, configs) -> int:
    name = ns.benchmark
    if name not in BENCHMARKS:
        listed = "\n".join(f"  {k:<20} {v}" for k, v in BENCHMARKS.items())
        print(f"splitserve bench: unknown benchmark {name!r}; choose one of:\n{listed}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"bench.{name}")
    sys.argv = [f"splitserve bench {name}", *ns.args]
    return int(module.main() or 0)
