"""Ways to move one request's KV (a contiguous range of a block-major pool) between two
processes on two GPUs, timed one transfer at a time the way a pull runs (synchronised each time).

    python -m bench.kv_copy_variants --mib 256 --pool-gib 64 --json out.json

CUDA IPC: an owner process on `cuda:0` allocates a pool of --pool-gib and exports it; a consumer
process maps it and copies --mib from its middle into its own pool on `cuda:1` by:
    torch_copy      dst.copy_(src) (torch issues a cross-device copy on the source device's stream)
    torch_splitN    the same cut into N pieces on N source-device streams (several copy engines)
    sm_push         a Triton copy kernel on the source device writing peer memory
and, for reference, the same copies from an ordinary tensor of the consumer's on `cuda:0`.
Every variant is timed with CUDA events on the destination device's stream, which waits for it.
NCCL: a 2-rank group built from a TCPStore (as the services do); the receiver posts first, the
sender starts 2 ms later; one configuration per process pair (NCCL reads its settings at init).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import statistics
import subprocess
import sys
import time

REPEATS = 10
NCCL_VARIANTS = {
    "default": {},
    "default, 200 ms idle before": {"PROBE_IDLE_S": "0.2"},
    "nvl_chunk_2m": {"NCCL_P2P_NVL_CHUNKSIZE": str(2 << 20)},
    "min_channels_32": {"NCCL_MIN_P2P_NCHANNELS": "32", "NCCL_MIN_NCHANNELS": "32"},
}
# --nccl-set service: from the probe's conditions one step at a time to the services' (why does the
# services' send take 1.3-1.5 ms against 0.8 here?)
NCCL_SERVICE_VARIANTS = {
    "default": {},
    "sender rank 1 (as paired)": {"PROBE_SWAP": "1"},
    "bf16 pool": {"PROBE_DTYPE": "bfloat16"},
    "service timeline": {"PROBE_SERVICE": "1"},
    "service timeline, rank 1, bf16": {"PROBE_SERVICE": "1", "PROBE_SWAP": "1", "PROBE_DTYPE": "bfloat16"},
    "200 ms idle, rank 1, bf16": {"PROBE_IDLE_S": "0.2", "PROBE_SWAP": "1", "PROBE_DTYPE": "bfloat16"},
    "pairing message first, rank 1, bf16": {"PROBE_PAIRING": "1", "PROBE_SWAP": "1", "PROBE_DTYPE": "bfloat16"},
    "as the services (async error handling 2, wait timeout, pairing)": {
        "PROBE_PAIRING": "1",
        "PROBE_SWAP": "1",
        "PROBE_DTYPE": "bfloat16",
        "PROBE_WAIT_TIMEOUT": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    },
    "service, rank 1, bf16, P2P read": {
        "PROBE_SERVICE": "1",
        "PROBE_SWAP": "1",
        "PROBE_DTYPE": "bfloat16",
        "NCCL_P2P_READ_ENABLE": "1",
    },
    "service, rank 1, bf16, CE memcpy": {
        "PROBE_SERVICE": "1",
        "PROBE_SWAP": "1",
        "PROBE_DTYPE": "bfloat16",
        "NCCL_P2P_USE_CUDA_MEMCPY": "1",
    },
}


def timed(fn, streams, idle_s: float = 0.0) -> dict:
    """Median wall ms and device ms (events on the first stream) over REPEATS, after 2 warm-ups;
    `idle_s`: both GPUs idle this long before each copy."""
    import torch

    walls, devs = [], []
    for i in range(REPEATS + 2):
        for s in streams:
            s.synchronize()
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        time.sleep(idle_s)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record(streams[0])
        fn()
        e1.record(streams[0])
        for s in streams:
            s.synchronize()
        t1 = time.perf_counter()
        if i >= 2:
            walls.append((t1 - t0) * 1e3)
            devs.append(e0.elapsed_time(e1))
    return {
        "wall_ms": statistics.median(walls),
        "device_ms": statistics.median(devs),
        "wall_spread_ms": [min(walls), max(walls)],
    }


def triton_copy():
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    def run(src, dst, device):
        import torch

        n = src.numel()
        block = 8192
        with torch.cuda.device(device):
            _copy[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block, num_warps=8)

    return run


def split_copy(pieces: int, streams: list):
    """dst.copy_(src) cut into `pieces` on source-device streams (several copy engines at once)."""
    import torch

    def run(dst, src):
        for d, s, stream in zip(dst.chunk(pieces), src.chunk(pieces), streams):
            with torch.cuda.stream(stream):
                d.copy_(s, non_blocking=True)

    return run


def consumer(handle_path: str, mib: int, out_path: str) -> None:
    """Each variant timed on the destination's stream, a row printed as soon as it is measured."""
    import torch

    func, args = pickle.load(open(handle_path, "rb"))
    pool = func(*args)  # the owner's pool, mapped on cuda:0
    nbytes = mib << 20
    words = nbytes // 8
    mid = pool.numel() // 2
    src = pool[mid : mid + words]
    dst_pool = torch.empty(words * 4, dtype=torch.int64, device="cuda:1")
    dst = dst_pool[words : 2 * words]
    native = torch.empty(words, dtype=torch.int64, device="cuda:0")
    native.copy_(src)
    s1 = torch.cuda.current_stream(1)
    streams0 = [torch.cuda.Stream(device=0) for _ in range(8)]
    out = {}

    def measure(name, fn, check_src, idle_s=0.0):
        try:
            dst.zero_()
            row = timed(fn, [s1], idle_s)
            row["GBps"] = nbytes / row["device_ms"] / 1e6
            row["wall_GBps"] = nbytes / row["wall_ms"] / 1e6
            row["content_equal"] = bool(torch.equal(dst[::4097].cpu(), check_src[::4097].cpu()))
        except Exception as exc:
            row = {"error": repr(exc)[:300]}
        out[name] = row
        print("ROW", name, json.dumps(row), flush=True)
        json.dump(out, open(out_path, "w"), indent=1)

    measure("ipc torch_copy", lambda: dst.copy_(src, non_blocking=True), src)
    for idle in (0.02, 0.2):
        measure(f"ipc torch_copy after {idle * 1e3:.0f} ms idle", lambda: dst.copy_(src, non_blocking=True), src, idle)
        measure(
            f"native torch_copy after {idle * 1e3:.0f} ms idle",
            lambda: dst.copy_(native, non_blocking=True),
            native,
            idle,
        )
    for k in (2, 4):
        measure(f"ipc torch_split{k}", lambda k=k: split_copy(k, streams0)(dst, src), src)
    measure("native torch_copy", lambda: dst.copy_(native, non_blocking=True), native)
    copy = triton_copy()  # peer access is on: torch enabled it for the cross-device copies above

    def push():
        ready, done = torch.cuda.Event(), torch.cuda.Event()
        ready.record(s1)
        torch.cuda.current_stream(0).wait_event(ready)
        copy(src, dst, 0)
        done.record(torch.cuda.current_stream(0))
        s1.wait_event(done)

    measure("ipc sm_push (cuda:0 kernel)", push, src)


def owner(handle_path: str, ready: str, pool_gib: float) -> None:
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.set_device(0)
    pool = torch.empty(int(pool_gib * (1 << 30)) // 8, dtype=torch.int64, device="cuda:0")
    pool.random_()
    torch.cuda.synchronize()
    pickle.dump(reduce_tensor(pool), open(handle_path, "wb"))
    open(ready, "w").write("1")
    time.sleep(600)


def nccl_side(rank: int, port: int, mib: int, pool_gib: float) -> dict:
    """One rank of the NCCL probe. The sender is on cuda:0 and the receiver on cuda:1; knobs (env):
    PROBE_SWAP=1 makes the receiver rank 0 and the sender rank 1 (as the services pair: decode = 0);
    PROBE_DTYPE the pool's dtype (int64); PROBE_IDLE_S idle before each transfer; PROBE_SERVICE=1 the
    services' timeline: the receiver idles 100 ms, then posts; the sender runs ~40 ms of matmuls
    (a prefill) ending ~3 ms before the receiver posts, and sends 3 ms after it (the gRPC ask)."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroupNCCL

    swap = os.environ.get("PROBE_SWAP") == "1"
    service = os.environ.get("PROBE_SERVICE") == "1"
    sender = rank == (1 if swap else 0)
    torch.cuda.set_device(0 if sender else 1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    group = ProcessGroupNCCL(dist.PrefixStore("probe", store), rank, 2, ProcessGroupNCCL.Options())
    dtype = getattr(torch, os.environ.get("PROBE_DTYPE", "int64"))
    size = torch.empty((), dtype=dtype).element_size()
    words = (mib << 20) // size
    pool = torch.empty(int(pool_gib * (1 << 30)) // size, dtype=dtype, device="cuda")
    mid = pool.numel() // 2
    buf = pool[mid : mid + words]
    peer = 1 - rank
    mat = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) if service and sender else None
    if os.environ.get("PROBE_PAIRING") == "1":  # the services' pairing: one 1-element message first
        one = torch.zeros(1, device="cuda")
        (group.send([one], peer, 0) if sender else group.recv([one], peer, 0)).wait(datetime.timedelta(seconds=30))
    wait_timeout = datetime.timedelta(seconds=10) if os.environ.get("PROBE_WAIT_TIMEOUT") == "1" else None
    stream = torch.cuda.current_stream()
    walls, devs = [], []
    for i in range(REPEATS + 2):
        store.set(f"go{i}/{rank}", "1")
        store.wait([f"go{i}/{1 - rank}"])
        torch.cuda.synchronize()
        time.sleep(float(os.environ.get("PROBE_IDLE_S", "0")))
        if service:
            if sender:
                time.sleep(0.057)
                for _ in range(200):  # ~40 ms of 4096^3 bf16 matmuls
                    mat @ mat
                torch.cuda.synchronize()
                time.sleep(0.006)
            else:
                time.sleep(0.1)
        elif sender:
            time.sleep(0.002)  # the receiver waits, as a pull does
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record(stream)
        work = group.send([buf], peer, i) if sender else group.recv([buf], peer, i)
        work.wait(wait_timeout) if wait_timeout else work.wait()
        e1.record(stream)
        stream.synchronize()
        t1 = time.perf_counter()
        if i >= 2:
            walls.append((t1 - t0) * 1e3)
            devs.append(e0.elapsed_time(e1))
    return {
        "rank": rank,
        "sender": sender,
        "wall_ms": statistics.median(walls),
        "device_ms": statistics.median(devs),
        "device_ms_all": [round(d, 3) for d in devs],
        "GBps": (mib << 20) / statistics.median(devs) / 1e6,
        "wall_GBps": (mib << 20) / statistics.median(walls) / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--pool-gib", type=float, default=64.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-nccl", action="store_true")
    parser.add_argument("--skip-ipc", action="store_true")
    parser.add_argument("--only-variants", default=None, help="comma-separated indexes into the NCCL set")
    parser.add_argument(
        "--nccl-set",
        choices=("settings", "service"),
        default="settings",
        help="settings: NCCL tunables; service: the probe's conditions stepped toward the services'",
    )
    parser.add_argument("--phase-timeout", type=float, default=90.0, help="seconds for each process group")
    parser.add_argument("--role", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--arg", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "owner":
        return owner(args.arg[0], args.arg[1], args.pool_gib)
    if args.role == "consumer":
        return consumer(args.arg[0], args.mib, args.arg[1])
    if args.role == "nccl":
        print(
            "RESULT " + json.dumps(nccl_side(int(args.arg[0]), int(args.arg[1]), args.mib, args.pool_gib)), flush=True
        )
        return

    me = [sys.executable, "-m", "bench.kv_copy_variants", "--mib", str(args.mib), "--pool-gib", str(args.pool_gib)]
    results: dict = {"mib": args.mib, "pool_gib": args.pool_gib}
    if not args.skip_ipc:
        tmp = os.path.abspath(".kv_copy_probe")
        os.makedirs(tmp, exist_ok=True)
        handle, ready = os.path.join(tmp, "handle.pkl"), os.path.join(tmp, "ready")
        for f in (handle, ready):
            if os.path.exists(f):
                os.remove(f)
        own = subprocess.Popen(me + ["--role", "owner", "--arg", handle, "--arg", ready])
        try:
            for _ in range(1200):
                if os.path.exists(ready):
                    break
                time.sleep(0.1)
            ipc_json = os.path.join(tmp, "ipc.json")
            try:
                subprocess.run(
                    me + ["--role", "consumer", "--arg", handle, "--arg", ipc_json], timeout=args.phase_timeout
                )
            except subprocess.TimeoutExpired:
                print("consumer timed out", flush=True)
            results["ipc"] = json.load(open(ipc_json)) if os.path.exists(ipc_json) else {}
        finally:
            own.kill()
    if not args.skip_nccl:
        results["nccl"] = {}
        variants = NCCL_SERVICE_VARIANTS if args.nccl_set == "service" else NCCL_VARIANTS
        if args.only_variants:
            keep = {int(i) for i in args.only_variants.split(",")}
            variants = {k: v for i, (k, v) in enumerate(variants.items()) if i in keep}
        for port, (name, env) in enumerate(variants.items(), start=29711):
            procs = [
                subprocess.Popen(
                    me + ["--role", "nccl", "--arg", str(r), "--arg", str(port)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env={**os.environ, **env},
                )
                for r in range(2)
            ]
            sides = []
            for p in procs:
                try:
                    o, _ = p.communicate(timeout=args.phase_timeout)
                except subprocess.TimeoutExpired:
                    p.kill()
                    o, _ = p.communicate()
                got = [json.loads(l[7:]) for l in o.splitlines() if l.startswith("RESULT ")]
                if os.environ.get("NCCL_DEBUG"):  # what NCCL chose: transport, channels
                    print(
                        "\n".join(
                            l
                            for l in o.splitlines()
                            if " NCCL INFO " in l and ("via" in l or "hannel" in l or "version" in l.lower())
                        ),
                        flush=True,
                    )
                sides.append(got[0] if got else {"error": o[-1500:]})
            results["nccl"][name] = sides
            print("NCCL", name, json.dumps(sides)[:600], flush=True)
    print(f"\n{args.mib} MiB from the middle of a {args.pool_gib} GiB pool, cuda:0 -> cuda:1, median of {REPEATS}")
    print(f"{'variant':44} {'device ms':>10} {'GB/s':>8} {'wall ms':>9} {'wall GB/s':>10}")
    for name, row in results.get("ipc", {}).items():
        if "device_ms" in row:
            print(
                f"{name:34} {row['device_ms']:10.3f} {row['GBps']:8.1f} {row['wall_ms']:9.3f} {row['wall_GBps']:10.1f}"
                f"  equal={row['content_equal']}"
            )
        else:
            print(f"{name:34} {row}")
    for name, sides in results.get("nccl", {}).items():
        for side in sides:
            if "device_ms" in side:
                label = f"nccl {name} {'send' if side['sender'] else 'recv'}"
                print(
                    f"{label:44} {side['device_ms']:10.3f} {side['GBps']:8.1f} {side['wall_ms']:9.3f} "
                    f"{side['wall_GBps']:10.1f}"
                )
            else:
                print(f"nccl {name}: {str(side)[:300]}")
    if args.json:
        json.dump(results, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
