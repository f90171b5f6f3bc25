"""What moves the rate of one request's KV copy (256 MiB, cuda:0 -> cuda:1) between back-to-back
benchmarks and a service: the GPUs' state before the copy and whether the copied memory was copied just
before. One process (a CUDA IPC mapping copies as fast as an ordinary tensor: bench/kv_copy_variants.py).

    python -m bench.kv_copy_clocks --set state|memory|wake --json out.json

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
(bench/kv_copy_service_probe.py lays the same copy out like the services: two processes, CUDA IPC.)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
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
        return names + ["load_dst_hbm", "load_src_hbm", "load_dst_mm", "layers32", "layers32_idle", "layers32_under_mm"]
    if which == "wake":
        return [
            "warm",
            "idle",
            "wake_same_stream_gap0",
            "wake_same_stream_gap2",
            "wake_same_stream_gap10",
            "wake_other_stream",
            "wake_reverse",
            "wake_other_process_gap1",
            "wake_other_process_gap5",
            "wake_sm_kernel",
        ]
    names = [f"same_idle_{ms}ms" for ms in (0, 1, 5, 20, 50, 200)]
    names += ["rotate", "rotate_src", "rotate_dst", "rotate_idle"]
    for size in ("4KiB", "1MiB", "16MiB"):
        names += [f"link_{size}_idle", f"link_{size}_idle_rotate"]
    return names


def helper() -> None:
    """Another process that copies 1 MiB cuda:0 -> cuda:1 of its own each time a line arrives on stdin."""
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


class Probe:
    """Both GPUs' buffers, the state-setting helpers, and the timed copy of each scenario."""

    def __init__(self, args) -> None:
        import torch

        self.torch, self.args = torch, args
        self.nbytes = args.mib << 20
        self.words = self.nbytes // 8
        self.idle = args.idle_ms / 1000
        self.clocks = Clocks(torch)
        d0, d1 = self.d0, self.d1 = torch.device("cuda:0"), torch.device("cuda:1")
        self.src_pool = torch.randint(0, 1 << 30, (self.words * REGIONS,), dtype=torch.int64, device=d0)
        self.dst_pool = torch.zeros(self.words * REGIONS, dtype=torch.int64, device=d1)
        self.s0, self.s1 = torch.cuda.current_stream(d0), torch.cuda.current_stream(d1)
        self.side = {d: torch.cuda.Stream(device=d) for d in (d0, d1)}
        self.mats = {d: torch.randn(4096, 4096, dtype=torch.bfloat16, device=d) for d in (d0, d1)}
        self.hbm = {
            d: (torch.empty(1 << 30, dtype=torch.uint8, device=d), torch.empty(1 << 30, dtype=torch.uint8, device=d))
            for d in (d0, d1)
        }
        self.link_src = torch.ones(16 << 20, dtype=torch.uint8, device=d0)
        self.link_dst = torch.empty(16 << 20, dtype=torch.uint8, device=d1)
        self.back0 = torch.empty(1 << 20, dtype=torch.uint8, device=d0)
        self.sm_copy = None
        self.helper_proc = None
        self.mm_ms = self._calibrate()
        print(f"one 4096^3 bf16 matmul warm: {self.mm_ms:.3f} ms")

    def _calibrate(self) -> float:
        torch, d0 = self.torch, self.d0
        for _ in range(20):
            self.mats[d0] @ self.mats[d0]
        self.sync()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(self.s0)
        for _ in range(50):
            self.mats[d0] @ self.mats[d0]
        e1.record(self.s0)
        self.sync()
        return e0.elapsed_time(e1) / 50

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.d0)
        self.torch.cuda.synchronize(self.d1)

    def region(self, pool, r: int):
        return pool[r * self.words : (r + 1) * self.words]

    def matmuls(self, d, ms: float, stream=None) -> None:
        with self.torch.cuda.stream(stream or self.torch.cuda.current_stream(d)):
            for _ in range(max(1, round(ms / self.mm_ms))):
                self.mats[d] @ self.mats[d]

    def busy_for(self, d, seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            self.matmuls(d, 5.0)
            self.torch.cuda.current_stream(d).synchronize()

    def prepare(self, name: str, src, dst) -> None:
        """Bring the GPUs into the scenario's state; anything enqueued here runs before the timed copy."""
        d0, d1 = self.d0, self.d1
        if name in ("warm", "layers32", "same_idle_0ms"):
            dst.copy_(src, non_blocking=True)
        elif name.startswith("rotate") and not name.endswith("idle"):
            pass  # back to back: the previous repeat's copy just ran (from/to another region)
        elif name == "src_busy":
            self.busy_for(d0, self.idle)
        elif name == "dst_busy":
            self.busy_for(d1, self.idle)
        elif name.startswith("same_idle_"):
            time.sleep(float(name[len("same_idle_") : -2]) / 1000)
        else:
            time.sleep(self.idle)
        if name.startswith("wake_"):
            self.wake(name)
        elif name.startswith("kick_"):
            _, who, ms = name.split("_")
            for d in {"dst": [d1], "src": [d0], "both": [d0, d1]}[who]:
                self.matmuls(d, float(ms[:-2]))
        elif name in ("load_dst_hbm", "load_src_hbm"):
            d = d1 if "dst" in name else d0
            with self.torch.cuda.stream(self.side[d]):
                for _ in range(4):
                    self.hbm[d][0].copy_(self.hbm[d][1], non_blocking=True)
        elif name == "load_dst_mm":
            self.matmuls(d1, 8.0, self.side[d1])

    def wake(self, name: str) -> None:
        """--set wake: a 1 MiB copy by the scenario's means ahead of the timed copy."""
        torch, d0 = self.torch, self.d0
        small0, small1 = self.link_src[: 1 << 20], self.link_dst[: 1 << 20]
        if name.startswith("wake_same_stream"):
            small1.copy_(small0, non_blocking=True)
            torch.cuda.synchronize(d0)
            time.sleep(float(name.split("gap")[1]) / 1000)
        elif name == "wake_other_stream":
            with torch.cuda.stream(self.side[d0]):
                small1.copy_(small0, non_blocking=True)
            self.side[d0].synchronize()
        elif name == "wake_reverse":
            self.back0.copy_(small1, non_blocking=True)
            self.sync()
        elif name.startswith("wake_other_process"):
            if self.helper_proc is None:
                self.helper_proc = subprocess.Popen(
                    [sys.executable, "-m", "bench.kv_copy_clocks", "--helper"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                assert self.helper_proc.stdout.readline().strip() == "ready"
            self.helper_proc.stdin.write("go\n")
            self.helper_proc.stdin.flush()
            assert self.helper_proc.stdout.readline().strip() == "done"
            time.sleep(float(name.split("gap")[1]) / 1000)
        elif name == "wake_sm_kernel":
            if self.sm_copy is None:
                from bench.kv_copy_variants import triton_copy

                self.sm_copy = triton_copy()
            self.sm_copy(small0, small1, d0)
            torch.cuda.synchronize(d0)

    @staticmethod
    def regions_for(name: str, i: int) -> tuple[int, int]:
        r = (i * 7) % REGIONS  # 7 is prime to 32: a region comes back only after 32 copies
        if name in ("rotate", "rotate_idle") or name.endswith("_rotate"):
            return r, r
        if name == "rotate_src":
            return r, 0
        if name == "rotate_dst":
            return 0, r
        return 0, 0

    def copy_once(self, name: str, src, dst) -> tuple[float, float, float | None]:
        """The timed copy: (destination-stream ms, source-stream ms, ms of a link_* small copy ahead)."""
        torch, d0, s0, s1 = self.torch, self.d0, self.s0, self.s1
        a1, b1, a0, b0, l0 = (torch.cuda.Event(enable_timing=True) for _ in range(5))
        if name.startswith("link_"):
            size = {"4KiB": 4 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}[name.split("_")[1]]
            l0.record(s0)
            self.link_dst[:size].copy_(self.link_src[:size], non_blocking=True)
        pieces = list(zip(src.chunk(32), dst.chunk(32))) if name.startswith("layers32") else [(src, dst)]
        if name == "layers32_under_mm":
            self.matmuls(d0, 12.0)  # the "prefill" on the source's main stream; the push on a side stream
            a0.record(self.side[d0])
            with torch.cuda.stream(self.side[d0]):
                for piece_s, piece_d in pieces:
                    piece_d.copy_(piece_s, non_blocking=True)
            b0.record(self.side[d0])
            a1.record(s1)
            b1.record(s1)
        else:
            a1.record(s1)
            a0.record(s0)
            for piece_s, piece_d in pieces:
                piece_d.copy_(piece_s, non_blocking=True)
            b0.record(s0)
            b1.record(s1)
        self.sync()
        return a1.elapsed_time(b1), a0.elapsed_time(b0), l0.elapsed_time(a0) if name.startswith("link_") else None

    def measure(self, name: str) -> dict:
        dev_dst, dev_src, link_ms, clk = [], [], [], []
        ok = True
        for i in range(REPEATS + 2):
            rs, rd = self.regions_for(name, i)
            src, dst = self.region(self.src_pool, rs), self.region(self.dst_pool, rd)
            self.sync()
            self.prepare(name, src, dst)
            c = self.clocks.sm()
            dst_ms, src_ms, link = self.copy_once(name, src, dst)
            ok = ok and bool(self.torch.equal(dst[::4097].cpu(), src[::4097].cpu()))
            if i >= 2:
                dev_dst.append(dst_ms)
                dev_src.append(src_ms)
                if link is not None:
                    link_ms.append(link)
                clk.append(c)
        row = {
            "dst_ms": statistics.median(dev_dst),
            "src_ms": statistics.median(dev_src),
            "src_ms_spread": [min(dev_src), max(dev_src)],
            "clocks_before": clk[len(clk) // 2],
            "equal": ok,
        }
        if link_ms:
            row["link_copy_ms"] = statistics.median(link_ms)
        row["dst_GBps"] = self.nbytes / row["dst_ms"] / 1e6 if row["dst_ms"] > 0.01 else None
        row["src_GBps"] = self.nbytes / row["src_ms"] / 1e6
        return row

    def close(self) -> None:
        if self.helper_proc is not None:
            self.helper_proc.stdin.close()
            self.helper_proc.wait(30)


def print_table(out: dict) -> None:
    ref = next(iter(out["rows"].values()))["src_GBps"]
    print(
        f"\n{out['mib']} MiB cuda:0 -> cuda:1, median of {REPEATS}; idle = {out['idle_ms']:.0f} ms; "
        f"SM clocks (MHz) read just before the copy; % of the first row"
    )
    print(
        f"{'scenario':24} {'dst-stream ms':>13} {'GB/s':>7} {'src-stream ms':>13} {'GB/s':>7} {'%':>7} "
        f"{'clocks src/dst':>15}"
    )
    for name, r in out["rows"].items():
        dg = f"{r['dst_GBps']:7.1f}" if r["dst_GBps"] else "      -"
        c = r["clocks_before"]
        extra = f"  (small copy {r['link_copy_ms']:.3f} ms)" if "link_copy_ms" in r else ""
        print(
            f"{name:24} {r['dst_ms']:13.3f} {dg} {r['src_ms']:13.3f} {r['src_GBps']:7.1f} "
            f"{100 * r['src_GBps'] / ref:6.1f}% {str(c[0]) + '/' + str(c[1]) if c else '-':>15}{extra}"
            f"{'' if r['equal'] else '  CONTENT DIFFERS'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", choices=("state", "memory", "wake"), default="memory")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--idle-ms", type=float, default=200.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--helper", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.helper:
        return helper()
    probe = Probe(args)
    out = {"set": args.set, "mib": args.mib, "idle_ms": args.idle_ms, "matmul_ms": probe.mm_ms, "rows": {}}
    try:
        for name in scenario_names(args.set):
            out["rows"][name] = probe.measure(name)
            print("ROW", name, json.dumps(out["rows"][name]), flush=True)
    finally:
        probe.close()
    print_table(out)
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
