"""`splitserve bench serve [ARGS...]`: the serving benchmark, the one benchmark that ships in the wheel.

The GPU probes, kernel timings and offline-throughput comparisons stay in the repository's
`benchmarks/` folder and run from a checkout as `python benchmarks/NAME.py`.
"""

from __future__ import annotations

import sys

from splitserve.bench import serve

IN_REPOSITORY = ("offline_throughput", "kernel_timings", "disagg_handoff", "pull_stall", "gateway_cost")


def run(ns, configs) -> int:
    name = ns.benchmark
    if name != "serve":
        where = f"; {name} runs from a checkout: python benchmarks/{name}.py" if name in IN_REPOSITORY else ""
        print(f"splitserve bench: unknown benchmark {name!r}; choose one of: serve{where}", file=sys.stderr)
        return 2
    sys.argv = [f"splitserve bench {name}", *ns.args]
    return int(serve.main() or 0)
