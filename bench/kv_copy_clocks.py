"""What moves the rate of one request's KV copy (256 MiB, cuda:0 -> cuda:1) between back-to-back
benchmarks and a service: the GPUs' state before the copy and whether the copied memory was copied just
before. One process (a CUDA IPC mapping copies as fast as an ordinary tensor: bench/kv_copy_variants.py).

    python -m bench.kv_copy_clocks --set state|memory --json out.json

Every scenario prepares a state, then copies the way a cuda_ipc pull does (`dst.copy_(src)`: torch runs
it on the source device's stream between two cross-device barriers), timed with CUDA events on the
destination stream (as the decode service does) and on the source stream; SM clocks of both GPUs are
read through NVML just before each copy. Sources and destinations are 256 MiB regions of 8 GiB pools.

--set state (same region every time):
    warm                      back to back
    idle                      both GPUs idle --idle-ms before the copy
    src_busy / dst_busy       one GPU ran matmuls for --idle-ms up to the copy, the other idle
    kick_{dst,src,both}_Kms   after idle, matmuls of about K ms on that GPU's stream ahead of the copy
    load_{dst,src}_hbm        after idle, an HBM-bound copy inside that GPU runs alongside (decode-like)
    load_dst_mm               after idle, matmuls run alongside on the destination (compute-bound)
    layers32[_idle|_under_mm] the same bytes as 32 copies of one layer each, back to back, after idle,
                              and from a side stream while the source runs matmuls (a layer-wise push)
--set memory:
    same_idle_Nms             the same region after N ms idle (N = 0 is back to back)
    rotate[_src|_dst]         back to back, each copy from (or to) a region not touched for 31 copies
    rotate_idle               a fresh region each time, after --idle-ms idle (what a service sees)
    link_B_idle[_rotate]      after idle, a B-byte peer copy just ahead (timed separately) of the copy
--set wake (which copy wakes what: after idle, a 1 MiB copy, then the timed copy):
    wake_same_stream_gapN     on the copy's stream, then N ms host sleep
    wake_other_stream         on another stream of the source device
    wake_reverse              cuda:1 -> cuda:0 (the other direction)
    wake_other_process_gapN   by another process (its own buffers, same direction), N ms before
    wake_sm_kernel            a copy kernel on cuda:0 writing cuda:1 memory (no copy engine)
--set service (laid out like the services: a "prefill" process owns a pool on cuda:0 and exports it; this
process maps it (CUDA IPC) and copies into its own pool on cuda:1; before each copy: --idle-ms idle, the
prefill computes ~50 ms of matmuls, then this process waits --lead-ms and copies):
    svc_none                  no wake writes
    svc_prefill_wake          the prefill writes 1 MiB into this process's buffer (IPC) as its compute ends
    svc_decode_wake           this process copies 1 MiB cuda:0 -> cuda:1 (its own buffers) when the compute ends
    svc_decode_touch          this process runs an empty kernel on its cuda:0 context when the compute ends
    svc_decode_ipc_wake       this process copies 1 MiB from the mapped pool when the compute ends
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

REPEATS = 8
REGIONS = 32


class Clocks:
    """SM clock (MHz) of each CUDA device through NVML, matched by PCI bus id; None where NVML is absent."""

    def __init__(self, torch) -> None:
        self.handles = []
        try:
            self.nvml = ctypes.CDLL("libnvidia-ml.so.1")
            if self.nvml.nvmlInit_v2() != 0:
                raise OSError("nvmlInit failed")
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                bus = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0".encode()
                h = ctypes.c_void_p()
                if self.nvml.nvmlDeviceGetHandleByPciBusId_v2(bus, ctypes.byref(h)) != 0:
                    raise OSError(f"no NVML handle for {bus}")
                self.handles.append(h)
        except OSError as exc:
            print("no clocks:", exc)
            self.handles = []

    def sm(self) -> list[int] | None:
        if not self.handles:
            return None
        out = []
        for h in self.handles:
            v = ctypes.c_uint()
            self.nvml.nvmlDeviceGetClockInfo(h, 1, ctypes.byref(v))
            out.append(v.value)
        return out


def scenario_names(which: str) -> list[str]:
    if which == "state":
        names = ["warm", "idle", "src_busy", "dst_busy"]
        for who in ("dst", "src", "both"):
            names += [f"kick_{who}_{ms}ms" for ms in ("0.25", "1", "3")]
        return names + ["load_dst_hbm", "load_src_hbm", "load_dst_mm", "layers32", "layers32_idle",
                        "layers32_under_mm"]
    if which == "service":
        return ["svc_warm", "svc_none", "svc_prefill_wake", "svc_decode_wake", "svc_decode_touch",
                "svc_decode_ipc_wake", "svc_none_again"]
    if which == "wake":
        return ["warm", "idle", "wake_same_stream_gap0", "wake_same_stream_gap2", "wake_same_stream_gap10",
                "wake_other_stream", "wake_reverse", "wake_other_process_gap1", "wake_other_process_gap5",
                "wake_sm_kernel"]
    names = [f"same_idle_{ms}ms" for ms in (0, 1, 5, 20, 50, 200)]
    names += ["rotate", "rotate_src", "rotate_dst", "rotate_idle"]
    for size in ("4KiB", "1MiB", "16MiB"):
        names += [f"link_{size}_idle", f"link_{size}_idle_rotate"]
    return names


def helper() -> None:
    """Another process that copies 1 MiB cuda:0 -> cuda:1 of its own each time a line arrives on stdin."""
    import sys

    import torch

    a = torch.ones(1 << 20, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(1 << 20, dtype=torch.uint8, device="cuda:1")
    b.copy_(a)
    torch.cuda.synchronize(0)
    print("ready", flush=True)
    for _ in sys.stdin:
        b.copy_(a)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        print("done", flush=True)


def prefill_like() -> None:
    """The "prefill" of --set service: a pool on cuda:0 exported over CUDA IPC; on "compute W" it runs
    ~50 ms of matmuls and, when W is 1, writes 1 MiB into the mapped buffer it was given."""
    import sys

    import torch

    from engine.kv_transfer.io import export_cuda_ipc, open_cuda_ipc

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


def service_like(args, torch, clocks) -> dict:
    import subprocess
    import sys

    from engine.kv_transfer.io import export_cuda_ipc, open_cuda_ipc

    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    proc = subprocess.Popen([sys.executable, "-m", "bench.kv_copy_clocks", "--prefill-like"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    pool = open_cuda_ipc(proc.stdout.readline().strip())
    wake_buffer = torch.zeros(1 << 20, dtype=torch.uint8, device=d1)
    proc.stdin.write(export_cuda_ipc(wake_buffer) + "\n")
    proc.stdin.flush()
    nbytes = args.mib << 20
    dst = torch.empty(nbytes, dtype=torch.uint8, device=d1)
    mine0 = torch.ones(1 << 20, dtype=torch.uint8, device=d0)
    s1 = torch.cuda.current_stream(d1)
    rows = {}
    for name in scenario_names("service"):
        times = []
        for i in range(REPEATS + 2):
            torch.cuda.synchronize(d0)
            torch.cuda.synchronize(d1)
            if name != "svc_warm":
                time.sleep(args.idle_ms / 1000)
                proc.stdin.write(f"compute {int(name == 'svc_prefill_wake')}\n")
                proc.stdin.flush()
                assert proc.stdout.readline().strip() == "done"
                if name == "svc_decode_wake":
                    wake_buffer.copy_(mine0, non_blocking=True)
                elif name == "svc_decode_touch":
                    with torch.cuda.device(d0):
                        torch.cuda._sleep(1000)
                elif name == "svc_decode_ipc_wake":
                    wake_buffer.copy_(pool[:1 << 20], non_blocking=True)
                time.sleep(args.lead_ms / 1000)
            off = (i % 3) * nbytes  # a different region of the pool each time, as requests use
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s1)
            dst.copy_(pool[off:off + nbytes], non_blocking=True)
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
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", choices=("state", "memory", "wake", "service"), default="memory")
    parser.add_argument("--lead-ms", type=float, default=4.0, help="--set service: compute end to copy")
    parser.add_argument("--helper", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prefill-like", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--idle-ms", type=float, default=200.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.helper:
        return helper()
    if args.prefill_like:
        return prefill_like()
    if args.set == "service":
        rows = service_like(args, torch, None)
        print(f"\n{args.mib} MiB from an IPC-mapped pool on cuda:0 (another process's) into cuda:1, median of "
              f"{REPEATS}; before each: {args.idle_ms:.0f} ms idle, ~50 ms prefill compute, {args.lead_ms} ms lead")
        for name, r in rows.items():
            print(f"{name:22} {r['dst_ms']:8.3f} ms {r['dst_GBps']:7.1f} GB/s {100 * r['dst_GBps'] / rows['svc_warm']['dst_GBps']:6.1f}%")
        if args.json:
            json.dump({"set": "service", "rows": rows}, open(args.json, "w"), indent=1)
        return
    nbytes = args.mib << 20
    words = nbytes // 8
    clocks = Clocks(torch)
    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    src_pool = torch.randint(0, 1 << 30, (words * REGIONS,), dtype=torch.int64, device=d0)
    dst_pool = torch.zeros(words * REGIONS, dtype=torch.int64, device=d1)
    s0, s1 = torch.cuda.current_stream(d0), torch.cuda.current_stream(d1)
    side = {d: torch.cuda.Stream(device=d) for d in (d0, d1)}
    mats = {d: torch.randn(4096, 4096, dtype=torch.bfloat16, device=d) for d in (d0, d1)}
    hbm = {d: (torch.empty(1 << 30, dtype=torch.uint8, device=d), torch.empty(1 << 30, dtype=torch.uint8, device=d))
           for d in (d0, d1)}
    link_src = torch.ones(16 << 20, dtype=torch.uint8, device=d0)
    link_dst = torch.empty(16 << 20, dtype=torch.uint8, device=d1)

    def region(pool, r):
        return pool[r * words:(r + 1) * words]

    def sync():
        torch.cuda.synchronize(d0)
        torch.cuda.synchronize(d1)

    for _ in range(20):
        mats[d0] @ mats[d0]
    sync()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(s0)
    for _ in range(50):
        mats[d0] @ mats[d0]
    e1.record(s0)
    sync()
    mm_ms = e0.elapsed_time(e1) / 50
    print(f"one 4096^3 bf16 matmul warm: {mm_ms:.3f} ms")

    def matmuls(d, ms, stream=None):
        with torch.cuda.stream(stream or torch.cuda.current_stream(d)):
            for _ in range(max(1, round(ms / mm_ms))):
                mats[d] @ mats[d]

    def busy_for(d, seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            matmuls(d, 5.0)
            torch.cuda.current_stream(d).synchronize()

    idle = args.idle_ms / 1000

    def prepare(name: str, src, dst) -> None:
        """Bring the GPUs into the scenario's state; anything enqueued here runs before the timed copy."""
        if name in ("warm", "layers32", "same_idle_0ms"):
            dst.copy_(src, non_blocking=True)
        elif name.startswith("rotate") and not name.endswith("idle"):
            pass  # back to back: the previous repeat's copy just ran (from/to another region)
        elif name == "src_busy":
            busy_for(d0, idle)
        elif name == "dst_busy":
            busy_for(d1, idle)
        elif name.startswith("same_idle_"):
            time.sleep(float(name[len("same_idle_"):-2]) / 1000)
        else:
            time.sleep(idle)
        if name.startswith("wake_"):
            wake(name)
        if name.startswith("kick_"):
            _, who, ms = name.split("_")
            for d in {"dst": [d1], "src": [d0], "both": [d0, d1]}[who]:
                matmuls(d, float(ms[:-2]))
        elif name in ("load_dst_hbm", "load_src_hbm"):
            d = d1 if "dst" in name else d0
            with torch.cuda.stream(side[d]):
                for _ in range(4):
                    hbm[d][0].copy_(hbm[d][1], non_blocking=True)
        elif name == "load_dst_mm":
            matmuls(d1, 8.0, side[d1])

    proc = None
    if args.set == "wake":
        import subprocess
        import sys

        proc = subprocess.Popen([sys.executable, "-m", "bench.kv_copy_clocks", "--helper"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
    small0, small1 = link_src[:1 << 20], link_dst[:1 << 20]
    back0 = torch.empty(1 << 20, dtype=torch.uint8, device=d0)
    sm_copy = None

    def wake(name: str) -> None:
        nonlocal sm_copy
        if name.startswith("wake_same_stream"):
            small1.copy_(small0, non_blocking=True)
            torch.cuda.synchronize(d0)
            time.sleep(float(name.split("gap")[1]) / 1000)
        elif name == "wake_other_stream":
            with torch.cuda.stream(side[d0]):
                small1.copy_(small0, non_blocking=True)
            side[d0].synchronize()
        elif name == "wake_reverse":
            back0.copy_(small1, non_blocking=True)
            torch.cuda.synchronize(d1)
            torch.cuda.synchronize(d0)
        elif name.startswith("wake_other_process"):
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "done"
            time.sleep(float(name.split("gap")[1]) / 1000)
        elif name == "wake_sm_kernel":
            if sm_copy is None:
                from bench.kv_copy_variants import triton_copy

                sm_copy = triton_copy()
            sm_copy(small0, small1, d0)
            torch.cuda.synchronize(d0)

    def regions_for(name: str, i: int) -> tuple[int, int]:
        r = (i * 7) % REGIONS  # 7 is prime to 32: a region comes back only after 32 copies
        if name in ("rotate", "rotate_idle") or name.endswith("_rotate"):
            return r, r
        if name == "rotate_src":
            return r, 0
        if name == "rotate_dst":
            return 0, r
        return 0, 0

    out = {"set": args.set, "mib": args.mib, "idle_ms": args.idle_ms, "matmul_ms": mm_ms, "rows": {}}
    for name in scenario_names(args.set):
        dev_dst, dev_src, link_ms, clk = [], [], [], []
        ok = True
        for i in range(REPEATS + 2):
            rs, rd = regions_for(name, i)
            src, dst = region(src_pool, rs), region(dst_pool, rd)
            sync()
            prepare(name, src, dst)
            c = clocks.sm()
            a1, b1, a0, b0, l0 = (torch.cuda.Event(enable_timing=True) for _ in range(5))
            if name.startswith("link_"):
                size = {"4KiB": 4 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}[name.split("_")[1]]
                l0.record(s0)
                link_dst[:size].copy_(link_src[:size], non_blocking=True)
            if name == "layers32_under_mm":
                matmuls(d0, 12.0)  # the "prefill" on the source's main stream; the push on a side stream
                a0.record(side[d0])
                with torch.cuda.stream(side[d0]):
                    for piece_s, piece_d in zip(src.chunk(32), dst.chunk(32)):
                        piece_d.copy_(piece_s, non_blocking=True)
                b0.record(side[d0])
                a1.record(s1)
                b1.record(s1)
            else:
                a1.record(s1)
                a0.record(s0)
                if name.startswith("layers32"):
                    for piece_s, piece_d in zip(src.chunk(32), dst.chunk(32)):
                        piece_d.copy_(piece_s, non_blocking=True)
                else:
                    dst.copy_(src, non_blocking=True)
                b0.record(s0)
                b1.record(s1)
            sync()
            ok = ok and bool(torch.equal(dst[::4097].cpu(), src[::4097].cpu()))
            if i >= 2:
                dev_dst.append(a1.elapsed_time(b1))
                dev_src.append(a0.elapsed_time(b0))
                if name.startswith("link_"):
                    link_ms.append(l0.elapsed_time(a0))
                clk.append(c)
        row = {"dst_ms": statistics.median(dev_dst), "src_ms": statistics.median(dev_src),
               "src_ms_spread": [min(dev_src), max(dev_src)], "clocks_before": clk[len(clk) // 2], "equal": ok}
        if link_ms:
            row["link_copy_ms"] = statistics.median(link_ms)
        row["dst_GBps"] = nbytes / row["dst_ms"] / 1e6 if row["dst_ms"] > 0.01 else None
        row["src_GBps"] = nbytes / row["src_ms"] / 1e6
        out["rows"][name] = row
        print("ROW", name, json.dumps(row), flush=True)
    if proc is not None:
        proc.stdin.close()
        proc.wait(30)
    ref = next(iter(out["rows"].values()))["src_GBps"]
    print(f"\n{args.mib} MiB cuda:0 -> cuda:1, median of {REPEATS}; idle = {args.idle_ms:.0f} ms; "
          f"SM clocks (MHz) read just before the copy; % of the first row")
    print(f"{'scenario':24} {'dst-stream ms':>13} {'GB/s':>7} {'src-stream ms':>13} {'GB/s':>7} {'%':>7} "
          f"{'clocks src/dst':>15}")
    for name, r in out["rows"].items():
        dg = f"{r['dst_GBps']:7.1f}" if r["dst_GBps"] else "      -"
        c = r["clocks_before"]
        extra = f"  (small copy {r['link_copy_ms']:.3f} ms)" if "link_copy_ms" in r else ""
        print(f"{name:24} {r['dst_ms']:13.3f} {dg} {r['src_ms']:13.3f} {r['src_GBps']:7.1f} "
              f"{100 * r['src_GBps'] / ref:6.1f}% {str(c[0]) + '/' + str(c[1]) if c else '-':>15}{extra}"
              f"{'' if r['equal'] else '  CONTENT DIFFERS'}")
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
