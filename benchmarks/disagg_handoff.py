"""Disaggregated hand-off: prefill on one device, decode on another, per KV transport.

    python benchmarks/disagg_handoff.py --config benchmarks/configs/llama3-8b.json --dtype bfloat16 \
        --prefill-device cuda:0 --decode-device cuda:1 --transports nccl,cuda_ipc --json out.json

For each transport it starts a prefill and a decode service as processes, sends prompts one at a
time (Prefill, then the decode stream), and checks the tokens against the colocated engine run
in this process on the same prompts one at a time. It reports the KV data movement on the device
(CUDA events around the copy: the decode's pull for cuda_ipc, the prefill's send for nccl), the
pull's wall time in the decode core, and the hand-off latency (prefill's answer to the first decode
delta: pull, lease check, first decode step), against a plain device-to-device tensor copy of the
same size measured here back to back and after 200 ms of idle: an NVLink path left idle pays ~0.3 ms
to wake on its next copy (docs/performance.md, "Answered questions"), and `--pacing sequential` leaves it idle before
every pull; `--pacing overlapped` sends the next prompt while the previous one decodes.
`--variants plain,keeper:2,keepalive:2` runs every transport again with traffic that keeps the link
awake: from a separate process (keeper) or the decode's `--kv-link-keepalive-ms` (keepalive).

nixl (one-sided READs over UCX; on one host cuda_ipc between VRAM pools, with the GET setting the connector makes:
docs/kv-connector.md, "nixl on one host") needs the NIXL wheel on the GPU machine: benchmarks/gpu_nixl.sh says how
it travels. Its rows have no device time (UCX moves the bytes, no CUDA events around them): compare the pull
columns. With UCX_PROTO_INFO=y in this environment, each service's <log>.stdout.log shows the protocol UCX chose.
One GPU (nccl refuses two ranks on one device), Qwen3-0.6B's shape, a 2,048-token and a 32k-token prompt:

    python benchmarks/disagg_handoff.py --config benchmarks/configs/qwen3-0.6b.json --prefill-device cuda:0 \
        --decode-device cuda:0 --transports cuda_ipc,nixl --prompt-len 2048 --json nixl-2k.json
    python benchmarks/disagg_handoff.py --config benchmarks/configs/qwen3-0.6b.json --prefill-device cuda:0 \
        --decode-device cuda:0 --transports cuda_ipc,nixl --prompt-len 32768 --max-model-len 33024 \
        --num-kv-blocks 4200 --json nixl-32k.json

and on two GPUs (`--decode-device cuda:1`) with `--transports cuda_ipc,nccl,nixl`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from splitserve.bench.serve_launch import free_port
from splitserve.engine.kv_connectors.link_keepalive import MIN_PERIOD_MS

CONFIGS = Path(__file__).resolve().parent / "configs"
# Child processes run the installed package; PYTHONSAFEPATH keeps the cwd (a checkout's top-level folders have
# generic names: kernels/, engine/, common/) off their sys.path.
CHILD_ENV = {**os.environ, "PYTHONSAFEPATH": "1"}


def start(command: str, args: list[str], log_path: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", command, *args],
        env=CHILD_ENV,
        stdout=subprocess.PIPE,
        stderr=open(log_path, "w"),
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("READY"):
            drain_stdout(proc, log_path.with_suffix(".stdout.log"))
            return proc
        if not line and proc.poll() is not None:
            break
    raise RuntimeError(f"{command} did not start; log:\n{log_path.read_text()[-4000:]}")


def drain_stdout(proc: subprocess.Popen, path: Path) -> None:
    """Copy what a service prints after READY into `path`: UCX logs to stdout (UCX_PROTO_INFO=y, UCX_LOG_LEVEL), and a
    pipe nobody reads would block the service once full."""

    def copy() -> None:
        with open(path, "w") as out:
            for line in proc.stdout:
                out.write(line)
                out.flush()

    threading.Thread(target=copy, name=f"stdout-{path.stem}", daemon=True).start()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def copy_rate(num_bytes: int, src: str, dst: str, repeats: int = 10, idle_s: float = 0.0) -> float:
    """GB/s of a plain tensor copy src -> dst of num_bytes (median of repeats), timed like the
    transfers: CUDA events around the copy on the stream that runs it (the source device's).
    `idle_s`: both devices idle this long before each copy (the link then has to wake)."""
    import torch

    if not src.startswith("cuda"):
        return cpu_copy_rate(num_bytes, repeats, idle_s)
    a = torch.empty(num_bytes, dtype=torch.uint8, device=src)
    b = torch.empty(num_bytes, dtype=torch.uint8, device=dst)
    stream = torch.cuda.current_stream(a.device)
    times = []
    for i in range(repeats + 2):
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        time.sleep(idle_s)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        b.copy_(a)
        end.record(stream)
        torch.cuda.synchronize(dst)
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    return num_bytes / statistics.median(times) / 1e9


KEEPER = """
import sys, time, torch
src, dst, period = sys.argv[1], sys.argv[2], float(sys.argv[3]) / 1000
a = torch.ones(1 << 20, dtype=torch.uint8, device=src)
b = torch.empty(1 << 20, dtype=torch.uint8, device=dst)
print("ready", flush=True)
while True:
    b.copy_(a)
    torch.cuda.synchronize(src)
    time.sleep(period)
"""


def start_keeper(args, period_ms: float) -> subprocess.Popen | None:
    """A process of its own copying 1 MiB prefill device -> decode device every period_ms: traffic from
    outside the services that keeps the link between the devices from going idle (variant keeper:MS;
    keepalive:MS is the decode's own)."""
    if period_ms <= 0:
        return None
    proc = subprocess.Popen(
        [sys.executable, "-c", KEEPER, args.prefill_device, args.decode_device, str(period_ms)],
        env=CHILD_ENV,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("the link keeper did not start")
    return proc


def cpu_copy_rate(num_bytes: int, repeats: int, idle_s: float) -> float:
    """GB/s of a plain `copy_` between two host buffers of num_bytes (median of repeats, wall time)."""
    import torch

    a = torch.ones(num_bytes, dtype=torch.uint8)
    b = torch.empty(num_bytes, dtype=torch.uint8)
    times = []
    for i in range(repeats + 2):
        time.sleep(idle_s)
        start = time.perf_counter()
        b.copy_(a)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times) / 1e9


def parse_variant(text: str) -> tuple[str, float]:
    """'plain', 'keeper:MS' or 'keepalive:MS' -> (kind, ms)."""
    kind, _, ms = text.partition(":")
    try:
        period = float(ms) if ms else 0.0
    except ValueError:
        period = -1.0
    ok = (
        kind == "plain"
        and not ms
        or kind == "keeper"
        and 0 < period <= 1000
        or kind == "keepalive"
        and MIN_PERIOD_MS <= period <= 1000
    )  # nan compares False: refused
    if not ok:
        raise SystemExit(
            f"--variants: {text!r} is not plain, keeper:<ms> (0 < ms <= 1000) or keepalive:<ms> "
            f"({MIN_PERIOD_MS} <= ms <= 1000)"
        )
    return kind, period


def engine_flags(args, max_num_seqs: int) -> list[str]:
    """The engine flags a bench's prefill and decode share: `args`' dtype, KV cache dtype, max_model_len and
    num_kv_blocks."""
    sizes = ["--max-model-len", str(args.max_model_len), "--num-kv-blocks", str(args.num_kv_blocks)]
    dtypes = ["--dtype", args.dtype, "--kv-cache-dtype", args.kv_cache_dtype]
    return [*dtypes, *sizes, "--max-num-seqs", str(max_num_seqs)]


async def run_transport(args, transport: str, prompts: list[list[int]], logs: Path, variant: str = "plain") -> dict:
    from splitserve.protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

    kind, ms = parse_variant(variant)
    tag = transport if kind == "plain" else f"{transport} {variant}"
    keeper_ms = ms if kind == "keeper" else 0
    # explicit either way, so that 'plain' stays plain whatever the flag's default
    decode_extra = ["--kv-link-keepalive-ms", str(ms if kind == "keepalive" else 0)]

    p_port, d_port = free_port(), free_port()
    engine = ["--model", args.config, "--load-format", "dummy", *engine_flags(args, max_num_seqs=8)]
    engine += ["--block-size", str(args.block_size)]
    name = tag.replace(" ", "-").replace(":", "")
    prefill = decode = keeper = None
    try:
        prefill = start(
            "prefill",
            engine
            + [
                "--device",
                args.prefill_device,
                "--port",
                str(p_port),
                "--instance-name",
                f"p-{name}",
                "--kv-transport",
                transport,
            ],
            logs / f"p-{name}.log",
        )
        decode = start(
            "decode",
            engine
            + [
                "--device",
                args.decode_device,
                "--port",
                str(d_port),
                "--instance-name",
                f"d-{name}",
                "--kv-transport",
                transport,
                "--prefill-peers",
                f"127.0.0.1:{p_port}",
                "--kv-transfer-timeout-s",
                "30",
                *decode_extra,
            ],
            logs / f"d-{name}.log",
        )
        keeper = start_keeper(args, keeper_ms)
        p_stub = prefill_pb2_grpc.PrefillStub(grpc.aio.insecure_channel(f"127.0.0.1:{p_port}"))
        d_chan = grpc.aio.insecure_channel(f"127.0.0.1:{d_port}")
        d_stub = decode_pb2_grpc.DecodeStub(d_chan)
        inbox: asyncio.Queue = asyncio.Queue()

        async def requests():
            while (item := await inbox.get()) is not None:
                yield item

        call = d_stub.Generate(requests())
        sampling = common_pb2.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        tokens: dict[str, list[int]] = {}
        first_delta: dict[str, asyncio.Event] = {}
        finished: dict[str, asyncio.Event] = {}
        first_at: dict[str, float] = {}
        delta_at: dict[str, list[float]] = {}  # request -> when each of its deltas came
        first_step_ns: dict[str, int] = {}  # request -> the decode step that made its first delta (its wall time)

        async def read():
            async for out in call:
                for delta in out.deltas:
                    rid = delta.request_id
                    delta_at.setdefault(rid, []).append(time.perf_counter())
                    if not first_delta[rid].is_set():
                        first_at[rid] = time.perf_counter()
                        first_step_ns[rid] = out.step_ns
                        first_delta[rid].set()
                    tokens[rid].extend(delta.token_ids)
                    if delta.finish_reason:
                        finished[rid].set()

        reader = asyncio.create_task(read())
        results = []
        for i, prompt in enumerate(prompts):
            before = (await d_stub.Describe(common_pb2.DescribeRequest())).counters
            p_before = (await p_stub.Describe(common_pb2.DescribeRequest())).counters
            rid = f"{tag}-{i}"
            first_delta[rid], finished[rid] = asyncio.Event(), asyncio.Event()
            first = await p_stub.Prefill(
                prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling, seed=i),
                timeout=300,
            )
            answered = time.perf_counter()
            tokens[rid] = [first.first_token_id]
            await inbox.put(
                decode_pb2.DecodeIn(
                    request=decode_pb2.DecodeRequest(
                        request_id=rid,
                        prompt_token_ids=prompt,
                        sampling=sampling,
                        seed=i,
                        first_token_id=first.first_token_id,
                        kv=first.kv,
                    )
                )
            )
            await asyncio.wait_for(first_delta[rid].wait(), 300)  # the pull is committed before the first delta
            handoff = first_at[rid] - answered
            if args.pacing == "sequential":
                await asyncio.wait_for(finished[rid].wait(), 300)
            after = (await d_stub.Describe(common_pb2.DescribeRequest())).counters
            moved = after["kv_bytes_pulled"] - before.get("kv_bytes_pulled", 0)
            ns = after["kv_transfer_ns"] - before.get("kv_transfer_ns", 0)
            p_after = (await p_stub.Describe(common_pb2.DescribeRequest())).counters
            send_ns = p_after.get("kv_send_ns", 0) - p_before.get("kv_send_ns", 0)
            # data movement on the device (CUDA events around the copy): the pull's copy for cuda_ipc,
            # the send for nccl (the receive is already posted, so the send interval is the transfer)
            if transport == "nccl":
                device_ns = p_after.get("kv_send_device_ns", 0) - p_before.get("kv_send_device_ns", 0)
            else:
                device_ns = after.get("kv_copy_device_ns", 0) - before.get("kv_copy_device_ns", 0)
            ids = list(first.kv.block_ids)
            src_runs = 1 + sum(b != a + 1 for a, b in zip(ids, ids[1:])) if ids else 0
            gaps = [b - a for a, b in zip(delta_at[rid], delta_at[rid][1:])]  # batch 1: the decode's step period
            step_ms = statistics.median(gaps) * 1e3 if gaps and args.pacing == "sequential" else 0.0
            results.append(
                {
                    "request_id": rid,
                    "handoff_ms": handoff * 1e3,
                    "first_step_ms": first_step_ns[rid] / 1e6,
                    "step_period_ms": step_ms,
                    # neither the pull nor a decode step: the hops between client, service and core
                    "rest_ms": handoff * 1e3 - ns / 1e6 - step_ms if step_ms else 0.0,
                    "bytes": moved,
                    "src_block_runs": src_runs,
                    "transfer_ms": ns / 1e6,
                    "gb_s": moved / ns if ns else 0.0,
                    "send_ms": send_ns / 1e6,
                    "send_gb_s": moved / send_ns if send_ns else 0.0,
                    "device_ms": device_ns / 1e6,
                    "device_gb_s": moved / device_ns if device_ns else 0.0,
                }
            )
            print(transport, i, results[-1], flush=True)
        for rid in finished:
            await asyncio.wait_for(finished[rid].wait(), 300)
        for r in results:
            r["tokens"] = tokens[r["request_id"]]
        if keeper is not None and keeper.poll() is not None:
            raise RuntimeError(
                f"the link keeper died during the run (exit {keeper.returncode}): variant {variant} is void"
            )
        await inbox.put(None)
        call.cancel()
        reader.cancel()
        return {"transport": tag, "requests": results}
    finally:
        for proc in (keeper, prefill, decode):
            if proc is not None:
                stop(proc)


def colocated(args, prompts) -> list[list[int]]:
    from splitserve.engine import LLM, SamplingParams

    llm = LLM(
        model=args.config,
        load_format="dummy",
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.prefill_device,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=8,
        block_size=args.block_size,
    )
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = [llm.generate(prompt_token_ids=[p], sampling_params=params)[0].token_ids for p in prompts]
    del llm
    return outs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(CONFIGS / "llama3-8b.json"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"), help="both services' and colocated")
    ap.add_argument("--prefill-device", default="cuda:0")
    ap.add_argument("--decode-device", default="cuda:1")
    ap.add_argument("--transports", default="nccl,cuda_ipc")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument(
        "--pacing",
        choices=("sequential", "overlapped"),
        default="sequential",
        help="sequential: each request finishes before the next prefill, so the link idles "
        "before every pull; overlapped: the next prefill starts at the "
        "previous request's first token, so pulls land while the decode GPU is decoding "
        "(use --max-tokens long enough to outlast a prefill)",
    )
    ap.add_argument(
        "--variants",
        default="plain",
        help="comma list, each run for every transport: plain; keeper:MS (a process of its own copies "
        "1 MiB between the two devices every MS ms, traffic that keeps the link awake); "
        "keepalive:MS (the decode's --kv-link-keepalive-ms MS)",
    )
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--num-kv-blocks", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--logs", default="/tmp/disagg-logs")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    variants = args.variants.split(",")
    for variant in variants:  # all checked before anything runs
        if parse_variant(variant)[0] != "plain" and not args.decode_device.startswith("cuda"):
            raise SystemExit(f"--variants {variant}: keeping a link awake needs CUDA devices")
    vocab = json.loads(Path(args.config).read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    expected = colocated(args, prompts)
    report = {"args": vars(args), "transports": [], "failed": []}
    for variant in variants:
        for transport in args.transports.split(","):
            try:  # one stack failing (a keeper that died, a service that did not start) costs only its row
                result = asyncio.run(run_transport(args, transport, prompts, logs, variant))
            except Exception as exc:
                print(f"{transport} {variant} FAILED: {exc!r}"[:2000], flush=True)
                report["failed"].append({"transport": transport, "variant": variant, "error": repr(exc)[:4000]})
            else:
                result["tokens_equal"] = [r["tokens"] for r in result["requests"]] == expected
                result["variant"] = variant
                report["transports"].append(result)
            if args.json:  # written after every stack: a run cut short keeps what it measured
                Path(args.json).write_text(json.dumps(report, indent=2))
    if not report["transports"]:
        print("no stack completed")
        return 1
    kv_bytes = max(r["bytes"] for t in report["transports"] for r in t["requests"])
    report["copy_gb_s"] = copy_rate(kv_bytes, args.prefill_device, args.decode_device)
    report["copy_after_idle_gb_s"] = copy_rate(kv_bytes, args.prefill_device, args.decode_device, idle_s=0.2)
    print(
        f"\nprompt {args.prompt_len} tokens, KV {kv_bytes / 2**20:.0f} MiB per request, pacing {args.pacing}; "
        f"plain copy {args.prefill_device}->{args.decode_device} of that size: {report['copy_gb_s']:.0f} GB/s "
        f"back to back, {report['copy_after_idle_gb_s']:.0f} GB/s after 200 ms idle (% below: of back to back)"
    )
    print("moved = data movement on the device, CUDA events around the copy (cuda_ipc: the pull's copy;")
    print("        nccl: the prefill's send, the decode's receive already posted);")
    print("pull = decode core's wall time, request to blocks in place (nccl: includes asking the prefill);")
    print("send = prefill core's wall time, gather + send (nccl only); nixl: no device time (UCX moves the bytes)")
    print("hand-off = pull + step + rest: step = the decode's step period at batch 1 (median gap between the later")
    print("        deltas; sequential pacing only), first = wall time of the core's step() that made the first delta,")
    print("        rest = hand-off - pull - step (client, service and core hops)")
    print(
        f"{'transport':<26}{'tokens equal':>13}{'moved GB/s':>11}{'% of copy':>10}{'pull GB/s':>10}"
        f"{'% of copy':>10}{'send GB/s':>10}{'% of copy':>10}{'pull ms':>9}{'copy ms':>8}{'step ms':>8}"
        f"{'first ms':>9}{'rest ms':>8}{'handoff ms':>11}"
    )
    for t in report["transports"]:
        rates = [r["gb_s"] for r in t["requests"][1:]] or [t["requests"][0]["gb_s"]]  # first one warms up
        handoffs = [r["handoff_ms"] for r in t["requests"][1:]] or [t["requests"][0]["handoff_ms"]]
        sends = [r["send_gb_s"] for r in t["requests"][1:]] or [t["requests"][0]["send_gb_s"]]
        moved = [r["device_gb_s"] for r in t["requests"][1:]] or [t["requests"][0]["device_gb_s"]]
        t["median_gb_s"], t["median_handoff_ms"] = statistics.median(rates), statistics.median(handoffs)
        t["median_send_gb_s"], t["median_device_gb_s"] = statistics.median(sends), statistics.median(moved)
        pulls = [r["transfer_ms"] for r in t["requests"][1:]] or [t["requests"][0]["transfer_ms"]]
        t["median_pull_ms"] = statistics.median(pulls)
        for key in ("device_ms", "step_period_ms", "first_step_ms", "rest_ms"):
            values = [r[key] for r in t["requests"][1:]] or [t["requests"][0][key]]
            t[f"median_{key}"] = statistics.median(values)
        copy = report["copy_gb_s"]
        print(
            f"{t['transport']:<26}{str(t['tokens_equal']):>13}{t['median_device_gb_s']:>11.1f}"
            f"{100 * t['median_device_gb_s'] / copy:>9.1f}%{t['median_gb_s']:>10.1f}"
            f"{100 * t['median_gb_s'] / copy:>9.1f}%{t['median_send_gb_s']:>10.1f}"
            f"{100 * t['median_send_gb_s'] / copy:>9.1f}%{t['median_pull_ms']:>9.2f}{t['median_device_ms']:>8.2f}"
            f"{t['median_step_period_ms']:>8.2f}{t['median_first_step_ms']:>9.2f}{t['median_rest_ms']:>8.2f}"
            f"{t['median_handoff_ms']:>11.2f}"
        )
    for failed in report["failed"]:
        print(f"{failed['transport']} {failed['variant']}: FAILED ({failed['error'][:200]})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if all(t["tokens_equal"] for t in report["transports"]) and not report["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
