"""What a NIXL READ between two processes costs, per UCX setting and descriptor layout (VRAM on one GPU, or DRAM).

    source benchmarks/gpu_setup.sh && bash benchmarks/gpu_nixl.sh install && python3 benchmarks/nixl_probe.py
    python benchmarks/nixl_probe.py --device cpu --mib 16          # DRAM, on a CPU machine

For each variant (a set of UCX environment variables and how the owner's agent is driven) it starts two processes
with that environment: an owner that registers a pool of --mib MiB (each int32 its own index) with a NIXL agent
configured as the prefill's (`kv_connectors/nixl.py`: UCX backend, no NIXL progress thread, driven every PROGRESS_S
by a thread of its own; or NIXL's busy progress thread), and a reader configured as the decode's, which READs the
whole pool into its own for each descriptor layout (one descriptor; one per layer and K/V of Qwen3-0.6B's shape;
one per 32 KiB piece), polling as the connector does, checks every byte, and times it (median of --repeats after
a warm-up READ; a warm-up slower than 2 s is the only one). Variants start while --budget-s lasts. Every process
runs with UCX_PROTO_INFO=y: the protocol UCX chose for the READ (`ucp_get*`: cuda_ipc, or "software emulation" over
tcp/shared memory, staged through host memory) is printed from the reader's log under the table. The `connector`
variant runs the connectors themselves (NixlConnector in both processes, with the UCX settings it sets itself): one
pull of every block of a pool of whole Qwen3-0.6B-sized blocks. First it prints `nvidia-smi nvlink --status` and
UCX's own debug lines about NVLink and cuda_ipc's get zcopy. Logs: --logs (default /tmp/nixl-probe-logs).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

UCX_DEFAULTS = {"UCX_MEM_EVENTS": "no", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto"}
TLS_LIST = "cuda_ipc,cuda_copy,tcp,sm,self"
# name -> (UCX environment over UCX_DEFAULTS, how the owner's agent is driven: "ours" every PROGRESS_S, "nixl" busy)
VARIANTS = {  # in the order they run: what confirms the cause and the fix first
    "get-auto": ({}, "ours"),  # UCX's own default: cuda_ipc GET off unless NVLink is detected on GPU 0
    "get-y": ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}, "ours"),  # what the connector sets for a VRAM pool
    # the connectors themselves (NixlConnector in both processes, its own UCX defaults): one pull of every block
    "connector": ({}, "connector"),
    "get-y+mem-events": ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y", "UCX_MEM_EVENTS": "yes"}, "ours"),
    "get-auto+busy-owner": ({}, "nixl"),
    "get-auto+tls": ({"UCX_TLS": TLS_LIST}, "ours"),
    "get-y+tls": ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y", "UCX_TLS": TLS_LIST}, "ours"),
    # TCP only, as between hosts without RDMA: the owner's CPU answers the READ, so how often it is driven shows
    "tcp": ({"UCX_TLS": "tcp,cuda_copy,self"}, "ours"),
    "tcp+busy-owner": ({"UCX_TLS": "tcp,cuda_copy,self"}, "nixl"),
}
# Qwen3-0.6B's KV bytes per block (28 layers, K and V, 16 tokens, 8 heads of 128 in bf16) as float32 with 4 heads
PROBE_LAYOUT = dict(num_layers=28, num_kv_heads=4, head_dim=128, block_size=16, dtype="float32", model_id="nixl-probe")
# Qwen3-0.6B's shape: 28 layers, K and V each; a block-major pool moves a run of blocks as one descriptor
LAYOUTS = {"one": None, "per-layer-kv": 56, "32KiB": "32KiB"}
SLOW_S = 2.0
WAIT_S = 120.0


def nixl_api():
    """NIXL's API as the connector loads it (its environment defaults apply to what the variant leaves unset)."""
    from splitserve.engine.kv_connectors.nixl import load_nixl_api

    return load_nixl_api()


def make_agent(api, name: str, busy_thread: bool):
    config = api.nixl_agent_config(
        enable_prog_thread=busy_thread, backends=["UCX"], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    )
    return api.nixl_agent(name, config)


def make_pool(num_bytes: int, device: str):
    """A pool whose every int32 holds its own index (a byte landing at a wrong offset shows)."""
    import torch

    pool = torch.arange(num_bytes // 4, dtype=torch.int32, device=device)  # (num_bytes / 4,)
    if pool.is_cuda:
        torch.cuda.set_device(pool.device)
        torch.cuda.synchronize()
    return pool


def mem_of(pool) -> tuple[str, int]:
    return ("VRAM", pool.device.index) if pool.is_cuda else ("DRAM", 0)


def ucx_version() -> str:
    """The version of the libucp this process loaded (NIXL's bundled UCX), or "unknown"."""
    import ctypes

    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "libucp" in path and path.startswith("/"):
            lib = ctypes.CDLL(path)
            lib.ucp_get_version_string.restype = ctypes.c_char_p
            return lib.ucp_get_version_string().decode()
    return "unknown"


def run_owner(args) -> None:
    """Register the pool, write the endpoint, drive the agent until stdin closes."""
    from splitserve.engine.kv_connectors.nixl import PROGRESS_S

    api = nixl_api()
    pool = make_pool(args.mib << 20, args.device)
    agent = make_agent(api, f"probe-owner-{os.getpid()}", busy_thread=args.progress == "nixl")
    mem, dev = mem_of(pool)
    agent.register_memory([(pool.data_ptr(), pool.numel() * 4, dev, "")], mem)
    stop = threading.Event()

    def drive() -> None:
        while not stop.wait(PROGRESS_S):
            agent.get_new_notifs()

    if args.progress == "ours":
        threading.Thread(target=drive, daemon=True).start()
    endpoint = {
        "agent": agent.name,
        "metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
        "addr": pool.data_ptr(),
        "mem": mem,
        "dev": dev,
        "ucx": ucx_version(),
    }
    tmp = Path(args.endpoint_file + ".tmp")
    tmp.write_text(json.dumps(endpoint))
    tmp.rename(args.endpoint_file)
    sys.stdin.readline()
    stop.set()


def probe_layout():
    from splitserve.common.kv_layout import KvLayout

    return KvLayout(**PROBE_LAYOUT)


def run_connector_owner(args) -> None:
    """A prefill's NixlConnector with a pool of --mib MiB (whole blocks; each int32 its own index)."""
    import torch

    from splitserve.engine.kv_connectors.factory import make_connector

    layout = probe_layout()
    io = make_connector({"transport": "nixl", "instance": "probe-p", "role": "prefill"})
    pool = io.kv_cache_factory(layout, max(1, (args.mib << 20) // layout.block_nbytes), torch.device(args.device))
    pool.view(-1).view(torch.int32).copy_(make_pool(pool.numel() * 4, args.device))
    endpoint = {"connector": io.endpoint, "ucx": ucx_version()}
    tmp = Path(args.endpoint_file + ".tmp")
    tmp.write_text(json.dumps(endpoint))
    tmp.rename(args.endpoint_file)
    sys.stdin.readline()
    io.close()


def run_connector_reader(args) -> None:
    """A decode's NixlConnector pulls every block (one run: one descriptor) as a lane worker would."""
    from types import SimpleNamespace

    import torch

    from splitserve.engine.kv_connectors.base import PullTarget
    from splitserve.engine.kv_connectors.factory import make_connector

    layout = probe_layout()
    endpoint = json.loads(Path(args.endpoint_file).read_text())["connector"]
    num_blocks = int(endpoint["num_blocks"])
    options = {"transport": "nixl", "instance": "probe-d", "role": "decode", "timeout_s": args.read_timeout_s}
    io = make_connector(options)
    dst = io.kv_cache_factory(layout, num_blocks, torch.device(args.device))
    expected = make_pool(dst.numel() * 4, args.device)
    io.map_source("probe-p", "nixl", endpoint, layout)
    blocks = list(range(num_blocks))
    spec = SimpleNamespace(transport="nixl", prefill_instance="probe-p", block_ids=blocks, endpoint=endpoint)
    times, ok = [], True
    env = {key: os.environ.get(key, "") for key in ("UCX_MEM_EVENTS", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY")}
    results: dict[str, dict] = {"ucx": {"version": ucx_version(), "env set by the connector": env}}
    try:
        for _ in range(args.repeats + 1):
            dst.zero_()
            if dst.is_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            io.pull(spec, blocks, blocks, PullTarget(dst, None))
            times.append(time.perf_counter() - start)
            ok = ok and bool(torch.equal(dst.view(-1).view(torch.int32), expected))
            if times[-1] > SLOW_S:
                break
        results["one"] = {"ms": [t * 1e3 for t in times], "ok": ok, "descs": 1, "bytes": dst.numel() * 4}
    except Exception as exc:
        results["one"] = {"error": repr(exc)[:300], "ms": [t * 1e3 for t in times], "descs": 1}
    io.close()
    Path(args.result_file).write_text(json.dumps(results))


def descriptors(layout, addr: int, num_bytes: int, dev: int) -> list[tuple[int, int, int]]:
    if layout is None:
        pieces = 1
    elif layout == "32KiB":
        pieces = num_bytes // (32 << 10)
    else:
        pieces = layout
    bounds = [i * num_bytes // pieces for i in range(pieces + 1)]
    return [(addr + lo, hi - lo, dev) for lo, hi in zip(bounds, bounds[1:])]


def timed_read(agent, remote: str, local, remote_descs, mem: str, remote_mem: str, timeout_s: float) -> float:
    """One READ as the connector runs it (initialize, transfer, poll every 100 us, release): seconds."""
    start = time.perf_counter()
    handle = agent.initialize_xfer(
        "READ", agent.get_xfer_descs(local, mem), agent.get_xfer_descs(remote_descs, remote_mem), remote
    )
    state = agent.transfer(handle)
    while state == "PROC" and time.perf_counter() - start < timeout_s:
        time.sleep(100e-6)
        state = agent.check_xfer_state(handle)
    agent.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError(f"READ ended in state {state} after {time.perf_counter() - start:.1f} s")
    return time.perf_counter() - start


def run_reader(args) -> None:
    """READ the owner's pool in every layout; write {layout: {ms: [...], ok: bool}} to the result file."""
    import torch

    api = nixl_api()
    endpoint = json.loads(Path(args.endpoint_file).read_text())
    num_bytes = args.mib << 20
    expected = make_pool(num_bytes, args.device)
    dst = torch.zeros_like(expected)
    agent = make_agent(api, f"probe-reader-{os.getpid()}", busy_thread=False)
    mem, dev = mem_of(dst)
    agent.register_memory([(dst.data_ptr(), num_bytes, dev, "")], mem)
    remote = agent.add_remote_agent(base64.b64decode(endpoint["metadata"]))
    remote = remote.decode() if isinstance(remote, bytes) else remote
    agent.make_connection(remote)
    results: dict[str, dict] = {"ucx": {"version": ucx_version()}}
    for name in args.layouts.split(","):
        local = descriptors(LAYOUTS[name], dst.data_ptr(), num_bytes, dev)
        remote_descs = descriptors(LAYOUTS[name], endpoint["addr"], num_bytes, endpoint["dev"])
        times, ok = [], True
        try:
            for i in range(args.repeats + 1):
                dst.zero_()
                if dst.is_cuda:
                    torch.cuda.synchronize()
                took = timed_read(agent, remote, local, remote_descs, mem, endpoint["mem"], args.read_timeout_s)
                ok = ok and bool(torch.equal(dst, expected))
                times.append(took)
                if took > SLOW_S:  # a slow path is timed once (its warm-up READ)
                    break
            results[name] = {"ms": [t * 1e3 for t in times], "ok": ok, "descs": len(local)}
        except Exception as exc:
            results[name] = {"error": repr(exc)[:300], "ms": [t * 1e3 for t in times], "descs": len(local)}
    Path(args.result_file).write_text(json.dumps(results))


def wait_for(path: Path, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} wrote nothing (exit {proc.poll()})")
        time.sleep(0.05)


def run_variant(args, name: str, logs: Path) -> dict:
    extra, progress = VARIANTS[name]
    env = {**os.environ, **UCX_DEFAULTS, **extra, "UCX_PROTO_INFO": "y", "PYTHONSAFEPATH": "1"}
    if progress == "connector":  # the connector's own defaults, whatever this shell says
        env = {key: value for key, value in env.items() if key not in UCX_DEFAULTS}
    tag = name.replace("+", "_")
    endpoint, result = logs / f"{tag}.endpoint", logs / f"{tag}.result"
    for path in (endpoint, result):
        path.unlink(missing_ok=True)
    common = [sys.executable, __file__, "--device", args.device, "--mib", str(args.mib)]
    common += ["--endpoint-file", str(endpoint)]
    owner_log, reader_log = logs / f"{tag}.owner.log", logs / f"{tag}.reader.log"
    owner = subprocess.Popen(
        [*common, "--role", "owner", "--progress", progress],
        env=env,
        stdin=subprocess.PIPE,
        stdout=open(owner_log, "w"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(endpoint, owner, "the owner")
        reader = [*common, "--role", "reader", "--progress", progress, "--result-file", str(result)]
        reader += ["--layouts", args.layouts]
        reader += ["--repeats", str(args.repeats), "--read-timeout-s", str(args.read_timeout_s)]
        budget = WAIT_S + len(args.layouts.split(",")) * (args.repeats + 1) * args.read_timeout_s
        with open(reader_log, "w") as out:
            subprocess.run(reader, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=budget, check=False)
        if not result.exists():
            raise RuntimeError(f"the reader wrote no result; its log:\n{reader_log.read_text()[-3000:]}")
        return {"variant": name, "env": extra, "owner_progress": progress, **json.loads(result.read_text())}
    finally:
        owner.stdin.close()
        try:
            owner.wait(30)
        except subprocess.TimeoutExpired:
            owner.kill()


def proto_lines(log: Path) -> list[str]:
    """UCX_PROTO_INFO's tables for remote memory (ucp_get: the READ; ucp_put), one line each: the operation, then
    each row's range, description and transport, e.g. "0..inf software emulation tcp/lo"."""
    tables: list[dict] = []
    for line in log.read_text(errors="replace").splitlines():
        body = line[line.find("|") :] if "|" in line else ""
        cells = [cell.strip() for cell in body.strip().strip("|").split("|")] if body else []
        if len(cells) == 1 and "cfg#" in cells[0]:
            tables.append({"cfg": cells[0], "op": "", "rows": []})
        elif tables and len(cells) == 1 and not tables[-1]["op"]:
            tables[-1]["op"] = cells[0]
        elif tables and len(cells) == 3 and cells[0] != "Range":
            tables[-1]["rows"].append(" ".join(cells))
    seen, lines = set(), []
    for table in tables:
        if "ucp_get" in table["op"] or "ucp_put" in table["op"]:
            text = f"{table['cfg']}: {table['op']}: {'; '.join(table['rows'])}"
            if text not in seen:
                seen.add(text)
                lines.append(text)
    return lines


def ucx_nvlink_lines() -> list[str]:
    """What UCX's cuda_ipc decides about gets at its default (`auto`): its debug lines about NVLink and get zcopy,
    from an agent created in a process of its own."""
    env = {**os.environ, **UCX_DEFAULTS, "UCX_LOG_LEVEL": "debug", "PYTHONSAFEPATH": "1"}
    command = [sys.executable, __file__, "--role", "ucx-check"]
    try:
        out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        return ["ucx-check: timed out"]
    lines = [line.split("UCX  DEBUG", 1)[-1].strip() for line in (out.stdout + out.stderr).splitlines()]
    found = [line for line in lines if "nvlink" in line.lower() or "get zcopy" in line.lower()]
    return [f"UCX: {line[:150]}" for line in found[:6]] or ["UCX: no debug line about NVLink or get zcopy"]


def gpu_topology(device: str) -> list[str]:
    """nvidia-smi's NVLink status (cuda_ipc GET is off, by UCX's default, where none is active)."""
    if not device.startswith("cuda"):
        return []
    out = []
    for cmd in (["nvidia-smi", "nvlink", "--status"], ["nvidia-smi", "-L"]):
        try:
            text = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired) as exc:
            text = f"{' '.join(cmd)}: {exc}"
        out += [f"{' '.join(cmd[1:])}: {line}" for line in text.splitlines()[:8]] or [f"{' '.join(cmd)}: (nothing)"]
    return out


def print_table(args, rows: list[dict]) -> None:
    layouts = args.layouts.split(",")
    print(f"\nREAD of {args.mib} MiB {args.device} -> {args.device}, two processes; ms median (GB/s); ! = bytes wrong")
    print(f"{'variant':<22}{'owner':>10}" + "".join(f"{n:>24}" for n in layouts))
    for row in rows:
        cells = []
        for name in layouts:
            cell = row.get(name)
            if cell is None:
                cells.append(f"{'-':>24}")
                continue
            if "error" in cell or not cell.get("ms"):
                cells.append(f"{'failed':>24}")
                continue
            timed = cell["ms"][1:] or cell["ms"]
            ms = statistics.median(timed)
            mark = "" if cell.get("ok") else "!"
            text = f"{ms:.2f} ({cell.get('bytes', args.mib << 20) / ms / 1e6:.1f}){mark} x{cell['descs']}"
            cells.append(f"{text:>24}")
        print(f"{row['variant']:<22}{row['owner_progress']:>10}" + "".join(cells))
        if "env set by the connector" in row["ucx"]:
            print(f"{'':<32}the connector's UCX environment: {row['ucx']['env set by the connector']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--mib", type=int, default=224, help="bytes per READ in MiB (224: a 2,048-token Qwen3-0.6B prompt)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--read-timeout-s", type=float, default=8.0)
    ap.add_argument("--budget-s", type=float, default=110.0, help="no variant starts after this many seconds")
    ap.add_argument("--logs", default="/tmp/nixl-probe-logs")
    ap.add_argument("--json", default="")
    ap.add_argument("--role", choices=("main", "owner", "reader", "ucx-check"), default="main", help=argparse.SUPPRESS)
    ap.add_argument("--progress", choices=("ours", "nixl", "connector"), default="ours", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint-file", default="", help=argparse.SUPPRESS)
    ap.add_argument("--result-file", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "ucx-check":
        make_agent(nixl_api(), f"probe-check-{os.getpid()}", busy_thread=False)
        return 0
    if args.role in ("owner", "reader"):
        roles = {"owner": (run_owner, run_connector_owner), "reader": (run_reader, run_connector_reader)}
        roles[args.role][args.progress == "connector"](args)
        return 0
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    unknown += [n for n in args.layouts.split(",") if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown variant or layout: {', '.join(unknown)}")
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    for line in gpu_topology(args.device) + (ucx_nvlink_lines() if args.device.startswith("cuda") else []):
        print(line, flush=True)
    rows, failed = [], []
    began = time.monotonic()
    for name in args.variants.split(","):
        if time.monotonic() - began > args.budget_s:
            failed.append({"variant": name, "error": f"skipped: --budget-s {args.budget_s:g} spent"})
            print(f"{name}: skipped (--budget-s spent)", flush=True)
            continue
        started = time.perf_counter()
        try:
            rows.append(run_variant(args, name, logs))
        except Exception as exc:
            failed.append({"variant": name, "error": repr(exc)[:2000]})
            print(f"{name}: FAILED {exc!r}"[:2000], flush=True)
            continue
        print(f"{name}: done in {time.perf_counter() - started:.1f} s, UCX {rows[-1]['ucx']['version']}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "failed": failed}, indent=2))
    print_table(args, rows)
    for name in args.variants.split(","):
        log = logs / f"{name.replace('+', '_')}.reader.log"
        if log.exists():
            print(f"\n{name}: UCX_PROTO_INFO (reader)")
            for line in proto_lines(log):
                print(f"  {line}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "failed": failed}, indent=2))
    exact = all(cell.get("ok") for row in rows for name, cell in row.items() if name in LAYOUTS)
    return 0 if rows and not failed and exact else 1


if __name__ == "__main__":
    sys.exit(main())
