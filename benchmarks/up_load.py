"""Requests per second through a CPU `splitserve up`, and where each process's CPU time goes.

    python benchmarks/up_load.py [--bursts 256x1,256x16,1024x8] [--rounds 2] [--json out.json]
        [--variant LABEL=UP_FLAGS ...] [--splitserve LABEL=PATH ...]

Each variant starts `splitserve up --device cpu` (the embedded default model, one prefill and one decode
over shm, the gateway) on free loopback ports, waits for /ready, sends a few warm-up requests, then for each
burst NxT opens N Generate streams at once, T tokens each (seeded random token-id prompts of --prompt-len
tokens, ignore_eos, greedy) and reads: requests/s, TTFT p50/p99, the CPU seconds each process used during
the burst (utime + stime from /proc: `up`, the gateway, the prefill and decode service processes, their
engine-core children, and this bench process, the client), and the WARNING / ERROR lines `up` logged
meanwhile. Then it stops `up` (SIGINT, as Ctrl-C). Variants run in turn,
--rounds times, so a before/after pair sees the same machine load; the 1-minute load average is read before
and after every burst. `--splitserve LABEL=PATH` runs that variant with another installation's `splitserve`
(e.g. a copy of main, for a before/after of a code change); a variant's UP_FLAGS are added to `up`'s.
Prints one table row per (round, variant, burst) last and writes every record to --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from splitserve.bench.serve_launch import HOST, free_port
from splitserve.bench.serve_load import LengthDist, Progress, grpc_sender, make_workload, run_load
from splitserve.bench.serve_stats import Slo, summarize

ROLES = ("up", "gateway", "prefill", "prefill-core", "decode", "decode-core", "bench")
VOCAB_SIZE = 8192  # the embedded default model's
_TICKS_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Variant:
    label: str
    up_flags: tuple[str, ...] = ()
    splitserve: str = ""  # empty: the one beside this Python


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds = utime + stime) of a live process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS_S


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def process_roles(up_pid: int) -> dict[str, int]:
    """role -> pid for `up` and its tree: the services by their subcommand, engine cores as a service's
    spawned child (multiprocessing's resource tracker is left out)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            parents[int(entry)] = st[0]
    roles = {"up": up_pid}
    for pid, parent in parents.items():
        if parent != up_pid:
            continue
        argv = _cmdline(pid)
        service = next((r for r in ("gateway", "prefill", "decode") if r in argv), None)
        if service is None:
            continue
        roles[service] = pid
        for child, child_parent in parents.items():
            if child_parent == pid and any("spawn_main" in a for a in _cmdline(child)):
                roles[f"{service}-core"] = child
    return roles


def cpu_seconds(roles: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each role's process; "bench" is this process (the client)."""
    out = {role: st[1] for role, pid in roles.items() if (st := _stat(pid)) is not None}
    return out | {"bench": time.process_time()}


def log_problems(path: Path, offset: int) -> tuple[dict[str, int], int]:
    """WARNING / ERROR lines written to `path` after byte `offset`, grouped with numbers and ids masked
    (message -> count), and the new end offset."""
    with open(path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    found: dict[str, int] = {}
    for line in text.splitlines():
        if " WARNING " in line or " ERROR " in line:
            key = re.sub(r"[0-9a-f]{8,}|\d+(\.\d+)?", "N", line.split(" ", 2)[-1])[:160]
            found[key] = found.get(key, 0) + 1
    return found, offset + len(text.encode())


class UpProcess:
    """`splitserve up --device cpu` on free ports until stop()."""

    def __init__(self, variant: Variant, log_dir: Path, ready_timeout_s: float) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        ports = ["--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port)]
        ports += ["--prefill-port", str(free_port()), "--decode-port", str(free_port())]
        splitserve = variant.splitserve or str(Path(sys.executable).parent / "splitserve")
        argv = [splitserve, "up", "--device", "cpu", *ports, *variant.up_flags]
        self.log_path = log_dir / f"up-{variant.label}-{self.grpc_port}.log"
        with open(self.log_path, "w") as log:
            # PYTHONSAFEPATH: the cwd (a checkout's top-level folders have generic names) off every process's path
            env = {**os.environ, "PYTHONSAFEPATH": "1"}
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._wait_ready(ready_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"up exited with {self.proc.returncode}; log {self.log_path}")
            try:
                with urllib.request.urlopen(f"http://{HOST}:{self.http_port}/ready", timeout=2) as r:
                    if json.loads(r.read()).get("ready"):
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"up was not ready after {timeout_s:g} s; log {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


async def burst(port: int, num_requests: int, prompt_len: int, max_tokens: int, salt: int) -> dict:
    """num_requests Generate streams at once; the run's summary (splitserve.bench.serve_stats)."""
    import grpc

    from splitserve.protos import generation_pb2_grpc

    specs = make_workload(
        num_requests, LengthDist("fixed", prompt_len), LengthDist("fixed", max_tokens), VOCAB_SIZE, None, 0, salt
    )
    async with grpc.aio.insecure_channel(f"{HOST}:{port}") as channel:
        send = grpc_sender([generation_pb2_grpc.GenerationStub(channel)], 0.0, 600.0)
        progress = Progress(len(specs), f"{num_requests}x{max_tokens}", enabled=False)
        records, duration = await run_load(
            specs, [0.0] * len(specs), send, concurrency=None, max_seconds=600.0, progress=progress
        )
    return summarize(records, duration, Slo())


def measure(up: UpProcess, args, label: str, round_index: int, salt: int) -> list[dict]:
    roles = process_roles(up.proc.pid)
    missing = set(ROLES) - set(roles) - {"bench"}
    if missing:
        raise RuntimeError(f"processes not found under up ({up.proc.pid}): {sorted(missing)}")
    asyncio.run(burst(up.grpc_port, args.warmup, args.prompt_len, 2, salt=10_000 + salt))
    rows = []
    log_offset = up.log_path.stat().st_size
    for num_requests, max_tokens in args.bursts:
        salt += 1
        load_before = os.getloadavg()[0]
        cpu_before = cpu_seconds(roles)
        summary = asyncio.run(burst(up.grpc_port, num_requests, args.prompt_len, max_tokens, salt))
        cpu_after = cpu_seconds(roles)
        problems, log_offset = log_problems(up.log_path, log_offset)
        rows.append(
            {
                "variant": label,
                "round": round_index,
                "max_tokens": max_tokens,
                "requests": num_requests,
                "completed": summary["num_completed"],
                "errors": summary["errors"],
                "duration_s": summary["duration_s"],
                "requests_per_s": summary["request_throughput"],
                "ttft_p50_ms": summary["ttft_ms"]["p50"],
                "ttft_p99_ms": summary["ttft_ms"]["p99"],
                "e2e_p99_ms": summary["e2e_ms"]["p99"],
                "cpu_s": {r: round(cpu_after[r] - cpu_before[r], 2) for r in ROLES if r in cpu_after},
                "load_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                "log_problems": problems,
            }
        )
        print(format_row(rows[-1]), flush=True)
    return rows


def format_row(row: dict) -> str:
    cpu = row["cpu_s"]
    return (
        f"| {row['variant']} | {row['round']} | {row['requests']}x{row['max_tokens']} | {row['completed']} | "
        f"{row['duration_s']:.1f} | {row['requests_per_s']:.1f} | "
        f"{row['ttft_p50_ms']:.0f} | {row['ttft_p99_ms']:.0f} | "
        + " | ".join(f"{cpu.get(r, float('nan')):.2f}" for r in ROLES)
        + f" | {sum(row['log_problems'].values())} | {row['load_1m'][0]:.1f}-{row['load_1m'][1]:.1f} |"
    )


TABLE_HEAD = (
    "| variant | round | burst | ok | wall s | req/s | TTFT p50 ms | TTFT p99 ms | "
    + " | ".join(f"CPU s {r}" for r in ROLES)
    + " | log warnings | load 1m |\n|"
    + "---|" * (10 + len(ROLES))
)


def parse_bursts(text: str) -> list[tuple[int, int]]:
    """Bursts from "256x1,1024x8": [(256, 1), (1024, 8)]."""
    bursts = []
    for item in text.split(","):
        n, sep, t = item.partition("x")
        if not sep or not n.isdigit() or not t.isdigit() or int(n) < 1 or int(t) < 1:
            raise argparse.ArgumentTypeError(f"a burst is NxT with N, T >= 1 (e.g. 256x16), got {item!r}")
        bursts.append((int(n), int(t)))
    return bursts


def parse_variants(specs: list[str], binaries: list[str]) -> list[Variant]:
    paths = {}
    for spec in binaries:
        label, sep, path = spec.partition("=")
        if not sep:
            raise ValueError(f"--splitserve takes LABEL=PATH, got {spec!r}")
        paths[label] = path
    variants = []
    for spec in specs or ["default="]:
        label, sep, flags = spec.partition("=")
        if not sep or not label:
            raise ValueError(f"--variant takes LABEL=UP_FLAGS (flags may be empty), got {spec!r}")
        variants.append(Variant(label, tuple(shlex.split(flags)), paths.pop(label, "")))
    if paths:
        raise ValueError(f"--splitserve names labels no --variant has: {sorted(paths)}")
    return variants


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--bursts", type=parse_bursts, default="256x1,256x16", help="NxT,...: N streams at once, T tokens each"
    )
    ap.add_argument("--prompt-len", type=int, default=8, help="prompt tokens per request")
    ap.add_argument("--warmup", type=int, default=8, help="requests sent before the measured bursts")
    ap.add_argument("--rounds", type=int, default=1, help="every variant this many times, in turn")
    ap.add_argument("--variant", action="append", default=[], help="LABEL=UP_FLAGS, repeatable")
    ap.add_argument("--splitserve", action="append", default=[], help="LABEL=PATH of the splitserve to run")
    ap.add_argument("--ready-timeout-s", type=float, default=300.0)
    ap.add_argument("--log-dir", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    variants = parse_variants(args.variant, args.splitserve)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="splitserve-up-load-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    print(TABLE_HEAD, flush=True)
    for round_index in range(args.rounds):
        for variant in variants:
            up = UpProcess(variant, log_dir, args.ready_timeout_s)
            try:
                rows += measure(up, args, variant.label, round_index, salt=100 * round_index)
            finally:
                up.stop()
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "variants": [v.__dict__ for v in variants]}, indent=1))
    print(f"\nlogs in {log_dir}\n{TABLE_HEAD}")
    for row in rows:
        print(format_row(row))


if __name__ == "__main__":
    main()
