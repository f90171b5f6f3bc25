"""The KV copy laid out like the services, to find what wakes the GPU link for a pull: a "prefill"
process owns a pool on cuda:0 and exports it over CUDA IPC; this process maps it and copies 256 MiB into
its own memory on cuda:1 (timed with CUDA events on the destination stream, as the decode service does).
Before each copy: --idle-ms idle, the prefill computes ~50 ms of matmuls, then this process waits
--lead-ms and copies.

    python -m bench.kv_copy_service_probe --json out.json

    svc_warm                  back to back (the reference)
    svc_none                  no wake writes
    svc_prefill_wake          the prefill writes 1 MiB into this process's buffer (IPC) as its compute ends
    svc_decode_wake           this process copies 1 MiB cuda:0 -> cuda:1 (its own buffers) when the compute ends
    svc_decode_touch          this process runs an empty kernel on its cuda:0 context when the compute ends
    svc_decode_ipc_wake       this process copies 1 MiB from the mapped pool when the compute ends
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

REPEATS = 8
SCENARIOS = (
    "svc_warm",
    "svc_none",
    "svc_prefill_wake",
    "svc_decode_wake",
    "svc_decode_touch",
    "svc_decode_ipc_wake",
    "svc_none_again",
)


def prefill_like() -> None:
    """The "prefill" of this probe: a pool on cuda:0 exported over CUDA IPC; on "compute W" it runs
    ~50 ms of matmuls and, when W is 1, writes 1 MiB into the mapped buffer it was given."""
    import torch

    from splitserve.engine.kv_transfer.ipc_handle import export_cuda_ipc, open_cuda_ipc

    d0 = torch.device("cuda:0")
    pool = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device=d0)
    mat = torch.randn(4096, 4096, dtype=torch.bfloat16, device=d0)
    torch.cuda.synchronize(d0)
    print(export_cuda_ipc(pool), flush=True)
    target = open_cuda_ipc(sys.stdin.readline().strip())
    source = torch.ones(target.numel(), dtype=torch.uint8, device=d0)
    stream = torch.cuda.Stream(d0)
    for line in sys.stdin:
        for _ in range(290):  # ~50 ms
            mat @ mat
        torch.cuda.synchronize(d0)
        if line.split()[1] == "1":
            with torch.cuda.stream(stream):
                target.copy_(source, non_blocking=True)
        print("done", flush=True)


def prefill_then_wake(args, proc, name: str, wake_buffer, mine0, pool) -> None:
    """Idle, let the prefill compute (and write, for svc_prefill_wake), do this scenario's wake, wait the lead."""
    import torch

    time.sleep(args.idle_ms / 1000)
    proc.stdin.write(f"compute {int(name == 'svc_prefill_wake')}\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "done"
    if name == "svc_decode_wake":
        wake_buffer.copy_(mine0, non_blocking=True)
    elif name == "svc_decode_touch":
        with torch.cuda.device(0):
            torch.cuda._sleep(1000)
    elif name == "svc_decode_ipc_wake":
        wake_buffer.copy_(pool[: 1 << 20], non_blocking=True)
    time.sleep(args.lead_ms / 1000)


def measure(args) -> dict:
    """Median device ms and GB/s of the copy in each scenario."""
    import torch

    from splitserve.engine.kv_transfer.ipc_handle import export_cuda_ipc, open_cuda_ipc

    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.kv_copy_service_probe", "--prefill-like"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    pool = open_cuda_ipc(proc.stdout.readline().strip())
    wake_buffer = torch.zeros(1 << 20, dtype=torch.uint8, device=d1)
    proc.stdin.write(export_cuda_ipc(wake_buffer) + "\n")
    proc.stdin.flush()
    nbytes = args.mib << 20
    dst = torch.empty(nbytes, dtype=torch.uint8, device=d1)
    mine0 = torch.ones(1 << 20, dtype=torch.uint8, device=d0)
    s1 = torch.cuda.current_stream(d1)
    rows = {}
    for name in SCENARIOS:
        times = []
        for i in range(REPEATS + 2):
            torch.cuda.synchronize(d0)
            torch.cuda.synchronize(d1)
            if name != "svc_warm":
                prefill_then_wake(args, proc, name, wake_buffer, mine0, pool)
            off = (i % 3) * nbytes  # a different region of the pool each time, as requests use
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s1)
            dst.copy_(pool[off : off + nbytes], non_blocking=True)
            b.record(s1)
            b.synchronize()
            if i >= 2:
                times.append(a.elapsed_time(b))
        ms = statistics.median(times)
        rows[name] = {"dst_ms": ms, "dst_GBps": nbytes / ms / 1e6, "spread": [min(times), max(times)]}
        print("ROW", name, json.dumps(rows[name]), flush=True)
    proc.stdin.close()
    proc.wait(30)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--idle-ms", type=float, default=200.0)
    parser.add_argument("--lead-ms", type=float, default=4.0, help="from the end of the prefill's compute to the copy")
    parser.add_argument("--json", default=None)
    parser.add_argument("--prefill-like", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prefill_like:
        return prefill_like()
    rows = measure(args)
    print(
        f"\n{args.mib} MiB from an IPC-mapped pool on cuda:0 (another process's) into cuda:1, median of "
        f"{REPEATS}; before each: {args.idle_ms:.0f} ms idle, ~50 ms prefill compute, {args.lead_ms} ms lead"
    )
    for name, r in rows.items():
        share = 100 * r["dst_GBps"] / rows["svc_warm"]["dst_GBps"]
        print(f"{name:22} {r['dst_ms']:8.3f} ms {r['dst_GBps']:7.1f} GB/s {share:6.1f}%")
    if args.json:
        json.dump({"rows": rows}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
