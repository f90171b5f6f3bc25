"""`splitserve up` as a new user runs it: start it, wait for its banner, send the README's completion
and a streamed chat through the `openai` client, read each process's GPU memory, stop it with Ctrl-C.

    python -m bench.up_check [--json out.json] [-- UP FLAGS...]      (e.g. -- --kv-transport cuda_ipc)

Prints a table (one row per step) and writes JSON. Exit code 0 when every step passed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time


def gpu_processes() -> list[dict]:
    """pid, name and used memory (MiB) of each process on the GPUs, from nvidia-smi ([] without one)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = []
    for line in out.strip().splitlines():
        pid, name, used = (part.strip() for part in line.split(","))
        rows.append({"pid": int(pid), "name": name, "used_mib": int(used)})
    return rows


def instance_of(pid: int) -> str:
    """The splitserve instance a GPU process belongs to: its own or its parent's --instance-name."""
    for candidate in (pid, parent_of(pid)):
        words = command_line(candidate).split()
        if "--instance-name" in words:
            return words[words.index("--instance-name") + 1]
    return command_line(pid)[-60:]


def parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def stop(proc: subprocess.Popen, step) -> None:
    """Ctrl-C to up, as a user stops it; then every GPU process must be gone."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    left = [row for row in gpu_processes()]
    step("stopped", code == 0 and not left, f"exit code {code}, {len(left)} GPU processes left")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--ready-timeout-s", type=float, default=420.0)
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("up_flags", nargs="*", help="flags for splitserve up (after --)")
    args = ap.parse_args()
    argv = [sys.executable, "-m", "splitserve.cli", "up", "--http-port", str(args.http_port), *args.up_flags]
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    up = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip())
            print("  | " + line.rstrip(), flush=True)
            if line.startswith("splitserve is up"):
                up.set()

    threading.Thread(target=read, daemon=True).start()
    results: dict = {"flags": args.up_flags, "steps": []}

    def step(name: str, ok: bool, detail: str) -> None:
        results["steps"].append({"step": name, "ok": ok, "detail": detail})

    try:
        ready = False
        deadline = time.monotonic() + args.ready_timeout_s
        while time.monotonic() < deadline and proc.poll() is None and not up.is_set():
            up.wait(0.5)
        ready = up.is_set()
        step("ready", ready, f"{time.monotonic() - started:.1f} s" if ready else f"exit code {proc.poll()}")
        if ready:
            time.sleep(0.5)  # the banner's remaining lines
            from openai import OpenAI

            client = OpenAI(base_url=f"http://127.0.0.1:{args.http_port}/v1", api_key="unused")
            try:
                text = (
                    client.completions.create(
                        model="default_model", prompt="def fibonacci(n):", max_tokens=48, temperature=0
                    )
                    .choices[0]
                    .text
                )
                step("completion", bool(text), repr(text[:80]))
            except Exception as exc:  # a failed step is reported, then the stack is stopped
                step("completion", False, f"{type(exc).__name__}: {exc}")
            try:
                chunks = client.chat.completions.create(
                    model="default_model",
                    stream=True,
                    max_tokens=32,
                    messages=[{"role": "user", "content": "What does os.path.join do?"}],
                )
                pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
                step("streamed chat", len(pieces) > 1, f"{len(pieces)} chunks: {''.join(pieces)[:60]!r}")
            except Exception as exc:
                step("streamed chat", False, f"{type(exc).__name__}: {exc}")
            memory = [dict(row, instance=instance_of(row["pid"])) for row in gpu_processes()]
            results["gpu_memory"] = memory
            for row in memory:
                step("gpu memory", True, f"{row['instance']}: {row['used_mib']} MiB (pid {row['pid']})")
    finally:
        stop(proc, step)
    results["log_tail"] = lines[-40:]
    print(f"\nsplitserve up {' '.join(args.up_flags)}")
    print(f"{'step':<16}{'ok':<6}detail")
    for s in results["steps"]:
        print(f"{s['step']:<16}{'yes' if s['ok'] else 'NO':<6}{s['detail']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if all(s["ok"] for s in results["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
