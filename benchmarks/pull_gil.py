"""Where a mapped-pool pull's wall time goes beyond its copy, and what a busy core loop adds through the GIL.

    python benchmarks/pull_gil.py --device cuda:0 --json pull_gil.json      (cuda_ipc's copy path, one GPU)
    python benchmarks/pull_gil.py --device cpu                               (shm's copy path)

One pull of --blocks consecutive blocks of the 8B shape (Llama-3-8B's KV: 32 layers, 8 KV heads of 128, block
size 16) from one pool to another in this process, measured five ways: the copy alone; the connector's `pull` on
the calling thread (its side stream, events and wait); through its transfer lane with the loop's wake pipe, the
loop idle (as the core waits when it has nothing to step); and through the lane while the loop runs Python, at
each switch interval of --intervals (the core process sets `core_process/gil.py`'s). Medians of --repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from multiprocessing import connection
from pathlib import Path
from types import SimpleNamespace

import torch

from splitserve.engine.core_process.loop import Wakeup
from splitserve.engine.kv_connectors.base import Load, PullTarget
from splitserve.engine.kv_connectors.cuda_ipc import CudaIpcConnector

BLOCK_SHAPE = (32, 2, 16, 8, 128)  # layers, K/V, block size, KV heads, head dim


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_alone(src: torch.Tensor, dst: torch.Tensor, n: int, repeats: int) -> float:
    walls = []
    for _ in range(repeats):
        sync(src.device)
        start = time.perf_counter()
        dst[n : 2 * n].copy_(src[:n], non_blocking=True)
        sync(src.device)
        walls.append(time.perf_counter() - start)
    return statistics.median(walls)


def make_connector(device: torch.device, src: torch.Tensor) -> CudaIpcConnector:
    """A decode's connector whose `prepare_pull` returns `src` (a pool of this process: no IPC handle to open)."""
    connector = CudaIpcConnector({"role": "decode", "instance": "bench"})
    connector.device = device
    connector.prepare_pull = lambda spec: src
    return connector


def pull_direct(connector, spec, src: torch.Tensor, dst: torch.Tensor, n: int, repeats: int) -> float:
    walls = []
    for _ in range(repeats):
        sync(src.device)
        start = time.perf_counter()
        connector.pull(spec, list(range(n)), list(range(n, 2 * n)), PullTarget(dst, None, src))
        walls.append(time.perf_counter() - start)
    return statistics.median(walls)


def pull_through_lane(connector, spec, dst: torch.Tensor, n: int, repeats: int, busy: bool) -> float:
    """start_load → the loop's poll reporting it: waiting on the wake pipe (idle) or running Python (busy)."""
    wake = Wakeup()
    connector.lanes.notify = wake.set
    walls = []
    for i in range(repeats):
        sync(dst.device)
        load = Load(f"r{i}", spec, list(range(n)), list(range(n, 2 * n)), dst)
        connector.start_load(load)
        while not connector.poll():
            if busy:
                sum(range(2000))  # the loop preparing a step: Python holding the GIL
            else:
                connection.wait([wake], 1.0)
                wake.clear()
        walls.append((time.perf_counter_ns() - load.start_ns) / 1e9)
    connector.lanes.notify = None
    wake.close()
    return statistics.median(walls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int, default=128, help="blocks in the pull (128 = 2,048 tokens)")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--intervals", default="0.005,0.0005,0.0002", help="switch intervals (s) for the busy loop")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    device, n = torch.device(args.device), args.blocks
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    src = torch.randn((2 * n, *BLOCK_SHAPE), dtype=dtype, device=device)
    dst = torch.zeros((2 * n, *BLOCK_SHAPE), dtype=dtype, device=device)
    spec = SimpleNamespace(block_ids=list(range(n)), transport="cuda_ipc", prefill_instance="p", endpoint={})
    spec.layout = SimpleNamespace(tensor_parallel_size=1)
    connector = make_connector(device, src)
    before = sys.getswitchinterval()
    rows = [
        ("the copy alone", copy_alone(src, dst, n, args.repeats)),
        ("connector.pull on its thread", pull_direct(connector, spec, src, dst, n, args.repeats)),
        ("through its lane, loop idle", pull_through_lane(connector, spec, dst, n, args.repeats, busy=False)),
    ]
    for interval in [float(x) for x in args.intervals.split(",") if x]:
        sys.setswitchinterval(interval)
        wall = pull_through_lane(connector, spec, dst, n, args.repeats, busy=True)
        rows.append((f"through its lane, loop running Python, {interval * 1e3:g} ms interval", wall))
    sys.setswitchinterval(before)
    connector.close()
    mib = n * src[0].numel() * src.element_size() / 2**20
    print(f"{n} blocks ({mib:.0f} MiB) on {device}, medians of {args.repeats}")
    print(f"{'way':<60}{'wall ms':>10}")
    for name, wall in rows:
        print(f"{name:<60}{wall * 1e3:>10.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": dict(rows)}, indent=1))


if __name__ == "__main__":
    main()
