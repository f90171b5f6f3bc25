"""Issue 22's adversarial findings, run again against `splitserve up` (CPU, the default model) on loopback:
one row per finding with what the issue measured before the change and what this run measures.

    python -m bench.adversarial [--streams 3000] [--idle 1000] [--steps crash,text,...] [--json F] [-- UP FLAGS]

Steps, in this order (SIGTERM stops the stack, so it is last): a forged internal first token (how long
until the stack serves again), a 20 MB and a 1 MB gRPC text while a stream runs (the stream's largest gap,
/health's slowest answer), a burst of concurrent streams (how each ended, instances still up), one
request_id sent to two gateways at once, forged PairKv / lease / prefill address, idle TCP connections
(how long until the gateway closed them), SIGTERM to `up` under 16 streams. The script knows the internal
token (it sets SPLITSERVE_INTERNAL_TOKEN for `up`), so the forged calls reach the checks behind it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import grpc
import httpx

from bench.stream_burst import gateway_burst, gateway_state, outcome_of
from splitserve.protos import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from splitserve.runtime.grpc_server import InternalAuth, internal_channel

TOKEN = os.environ.get("SPLITSERVE_INTERNAL_TOKEN") or secrets.token_hex(16)  # given: other tools can call too
ROWS: list[tuple[str, str, str]] = []  # (finding, before the change (issue 22), now)


def row(finding: str, before: str, now: str) -> None:
    ROWS.append((finding, before, now))
    print(f"[{time.strftime('%H:%M:%S')}] {finding}: {now}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ports:
    def __init__(self) -> None:
        self.prefill, self.decode, self.grpc, self.http = free_port(), free_port(), free_port(), free_port()
        self.decode = self.decode if self.decode + 1 not in (self.grpc, self.http, self.prefill) else free_port()

    def decodes(self) -> list[str]:
        """The decodes' addresses, as the gateway's /ready lists them."""
        ready = httpx.get(f"http://127.0.0.1:{self.http}/ready", timeout=30).json()
        return [i["address"] for i in ready["instances"] if i["role"] != "prefill"]


def start_up(ports: Ports, extra: list[str], log_path: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "splitserve.cli", "up", "--device", "cpu", "--prefill-port", str(ports.prefill)]
    argv += ["--decode-port", str(ports.decode), "--grpc-port", str(ports.grpc), "--http-port", str(ports.http)]
    env = dict(os.environ, SPLITSERVE_INTERNAL_TOKEN=TOKEN)
    log = open(log_path, "w")  # noqa: SIM115 (the child writes it until it ends)
    return subprocess.Popen(argv + extra, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(http: str, timeout_s: float = 600.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            r = httpx.get(f"{http}/ready", timeout=5)
            if r.status_code == 200 and all(i["up"] for i in r.json()["instances"]):
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"not ready after {timeout_s} s")


def completion_ok(http: str) -> bool:
    try:
        r = httpx.post(
            f"{http}/v1/completions", json={"prompt": "def f(n):", "max_tokens": 4, "temperature": 0}, timeout=10
        )
        return r.status_code == 200
    except httpx.HTTPError:
        return False


def internal(address: str):
    return internal_channel(address, InternalAuth(token=TOKEN))


SAMPLING = common_pb2.SamplingParams(max_tokens=8, temperature=0.0)


# -- 1: a forged first token -------------------------------------------------------------------
async def forged_first_token(ports: Ports, http: str) -> None:
    prefill = prefill_pb2_grpc.PrefillStub(internal(f"127.0.0.1:{ports.prefill}"))
    first = await prefill.Prefill(
        prefill_pb2.PrefillRequest(request_id="adv-crash", prompt_token_ids=[5, 6, 7, 8], sampling=SAMPLING),
        timeout=60,
    )
    forged = decode_pb2.DecodeRequest(
        request_id="adv-crash", prompt_token_ids=[5, 6, 7, 8], sampling=SAMPLING, first_token_id=2**32 - 1
    )
    forged.kv.CopyFrom(first.kv)
    decode = decode_pb2_grpc.DecodeStub(internal(ports.decodes()[0]))
    start = time.monotonic()
    answer = "no answer"
    async for out in decode.Generate(iter([decode_pb2.DecodeIn(request=forged)]), timeout=30):
        answer = "; ".join(d.error for d in out.deltas if d.error) or "tokens"
        break
    while not completion_ok(http) and time.monotonic() - start < 600:
        await asyncio.sleep(0.05)
    row(
        "1 forged first_token_id 2^32-1 (internal Decode.Generate)",
        "engine core died unnoticed; every later request hung 600 s",
        f"refused ({answer}); a completion served {time.monotonic() - start:.2f} s after the forged call",
    )


# -- 2: a huge text while a stream runs --------------------------------------------------------
_SENDER = """
import sys, grpc
from splitserve.protos import generation_pb2
data = generation_pb2.TokenizeRequest(text="w " * (int(sys.argv[2]) // 2)).SerializeToString()
channel = grpc.insecure_channel(sys.argv[1])
grpc.channel_ready_future(channel).result(timeout=60)
tokenize = channel.unary_unary("/splitserve.v1.Generation/Tokenize")
print("ready", flush=True)
sys.stdin.readline()
try:
    tokenize(data, timeout=120)
    print("OK", flush=True)
except grpc.RpcError as exc:
    print(exc.code().name, (exc.details() or "")[:90], flush=True)
"""


async def huge_text(ports: Ports, http: str, num_chars: int) -> None:
    stub = generation_pb2_grpc.GenerationStub(grpc.aio.insecure_channel(f"127.0.0.1:{ports.grpc}"))
    long = common_pb2.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    gaps, health_s, seen = [], [], asyncio.Event()

    async def stream() -> None:
        last = None
        async for _ in stub.Generate(generation_pb2.GenerateRequest(text="def f(n):", sampling=long), timeout=300):
            now = time.monotonic()
            if last is not None:
                gaps.append((last, now))
            last = now
            seen.set()

    async def health(stop: asyncio.Event) -> None:
        async with httpx.AsyncClient() as client:
            while not stop.is_set():
                t = time.monotonic()
                await client.get(f"{http}/health", timeout=60)
                health_s.append(time.monotonic() - t)
                await asyncio.sleep(0.05)

    # the text comes from a client process of its own, as an attacker's would: serializing 20 MB holds
    # the GIL ~0.25 s, and in this process that stalled this script's own stream reading (its event loop
    # lagged 0.2-0.6 s at load 7-8 while the gateway's did not: the earlier runs' 0.6-0.86 s "gaps")
    sender = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _SENDER,
        f"127.0.0.1:{ports.grpc}",
        str(num_chars),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert (await asyncio.wait_for(sender.stdout.readline(), 120)).strip() == b"ready"
    running = asyncio.create_task(stream())
    await asyncio.wait_for(seen.wait(), 120)
    await asyncio.sleep(2.0)  # a window without the big call: the gaps this loaded machine makes anyway
    stop = asyncio.Event()
    poller = asyncio.create_task(health(stop))

    async def send() -> str:
        sender.stdin.write(b"go\n")
        await sender.stdin.drain()
        answer = (await asyncio.wait_for(sender.stdout.readline(), 180)).decode().strip()
        await sender.wait()
        return answer

    start = time.monotonic()
    status = await send()
    end = time.monotonic()
    await asyncio.sleep(0.3)
    stop.set()
    await poller
    running.cancel()
    window = [b - a for a, b in gaps if b >= start and a <= end + 0.3]
    before = [b - a for a, b in gaps if start - 2.0 <= a and b < start]
    mb = num_chars / 1e6
    row(
        f"2 a {mb:g} MB gRPC text (Tokenize) while a stream runs",
        "8 MB froze every stream and /health 11.8 s; 20 MB 37 s",
        f"{status} in {end - start:.2f} s; the stream's largest gap {max(window, default=0):.3f} s "
        f"({max(before, default=0):.3f} s in the 2 s before), "
        f"/health slowest {max(health_s, default=0):.3f} s ({len(health_s)} polls)",
    )


# -- 4: a burst of streams -------------------------------------------------------------------
def marked_down(log_path: str, offset: int) -> list[str]:
    """The gateway's "... is down: ..." / "... marked down: ..." lines written to `up`'s log past `offset`."""
    with open(log_path, errors="replace") as f:
        f.seek(offset)
        return [line.strip() for line in f if " is down: " in line or " marked down: " in line]


async def burst(ports: Ports, http: str, num_streams: int, max_tokens: int, log_path: str) -> dict:
    offset = os.path.getsize(log_path)
    ended, elapsed = await gateway_burst(f"127.0.0.1:{ports.grpc}", num_streams, max_tokens=max_tokens)
    up, totals = gateway_state(http)
    down = marked_down(log_path, offset)
    counts = ", ".join(f"{n} {what}" for what, n in ended.most_common())
    row(
        f"4 {num_streams} concurrent gRPC streams (max_tokens {max_tokens})",
        "3 Describe timeouts in a row: instances marked down, 686 bare CANCELLED, uncounted",
        f"{counts}; {elapsed:.1f} s; instances up after: {up}; requests_total by status {totals}; "
        f"instances marked down during the burst: {len(down)}{' (first: ' + down[0][-160:] + ')' if down else ''}",
    )
    return dict(ended)


# -- 5: one request_id through two gateways ----------------------------------------------------
async def collision(ports: Ports, log_dir: str) -> None:
    grpc2, http2 = free_port(), free_port()
    argv = [sys.executable, "-m", "splitserve.cli", "gateway", "--grpc-port", str(grpc2), "--http-port", str(http2)]
    argv += ["--prefill", f"127.0.0.1:{ports.prefill}", "--decode", ",".join(ports.decodes())]
    log = open(os.path.join(log_dir, "gateway-2.log"), "w")  # noqa: SIM115
    second = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, SPLITSERVE_INTERNAL_TOKEN=TOKEN)
    )
    try:
        wait_ready(f"http://127.0.0.1:{http2}", 120)
        request = generation_pb2.GenerateRequest(request_id="same-id", text="def f(n):", sampling=SAMPLING)

        async def one(port: int) -> str:
            stub = generation_pb2_grpc.GenerationStub(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
            tokens, reason = 0, 0
            try:
                async for m in stub.Generate(request, timeout=60):
                    tokens += len(m.token_ids)
                    reason = m.finish_reason or reason
            except grpc.aio.AioRpcError as exc:
                return outcome_of(exc)[:50]
            return f"{tokens} tokens {common_pb2.FinishReason.Name(reason)}"

        start = time.monotonic()
        answers = await asyncio.gather(one(ports.grpc), one(grpc2))
        row(
            "5 one request_id to two gateways at once",
            "one client got no tokens and hung until its deadline",
            f"{' | '.join(answers)} in {time.monotonic() - start:.2f} s",
        )
    finally:
        second.terminate()
        second.wait(30)


# -- 6: forged PairKv, lease, prefill address --------------------------------------------------
async def forged_calls(ports: Ports) -> None:
    prefill = prefill_pb2_grpc.PrefillStub(internal(f"127.0.0.1:{ports.prefill}"))
    results = []
    calls = [
        (
            "PairKv as decode-0, store elsewhere",
            prefill.PairKv(
                prefill_pb2.PairKvRequest(
                    decode_instance="decode-0", store_host="127.0.0.1", store_port=9, backend="gloo"
                ),
                timeout=30,
            ),
        ),
        (
            "lease_ms 2^32-1",
            prefill.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id="adv-l", prompt_token_ids=[1, 2], sampling=SAMPLING, lease_ms=2**32 - 1
                ),
                timeout=30,
            ),
        ),
    ]
    for what, call in calls:
        try:
            await call
            results.append(f"{what}: accepted")
        except grpc.aio.AioRpcError as exc:
            results.append(f"{what}: {exc.code().name}")
    forged = decode_pb2.DecodeRequest(
        request_id="adv-addr", prompt_token_ids=[1, 2, 3], sampling=SAMPLING, first_token_id=5
    )
    forged.kv.CopyFrom(
        common_pb2.KvHandle(
            prefill_instance="p", prefill_address="10.9.9.9:1", block_ids=[0], num_tokens=3, transport="shm"
        )
    )
    decode = decode_pb2_grpc.DecodeStub(internal(ports.decodes()[0]))
    async for out in decode.Generate(iter([decode_pb2.DecodeIn(request=forged)]), timeout=30):
        results.append("handle naming 10.9.9.9:1: " + ("refused" if out.deltas[0].error else "served"))
        break
    unauth = prefill_pb2_grpc.PrefillStub(grpc.aio.insecure_channel(f"127.0.0.1:{ports.prefill}"))
    try:
        await unauth.ReleaseKv(prefill_pb2.ReleaseKvRequest(lease_id="x", epoch=1), timeout=10)
        results.append("without the token: accepted")
    except grpc.aio.AioRpcError as exc:
        results.append(f"without the token: {exc.code().name}")
    row(
        "6 forged internal calls",
        "PairKv from anyone tore down a pair; 49.7-day leases; any prefill_address dialed; no auth",
        "; ".join(results),
    )


# -- 7: idle connections -----------------------------------------------------------------------
def idle_connections(ports: Ports, num: int) -> None:
    socks = []
    for _ in range(num):
        s = socket.create_connection(("127.0.0.1", ports.http), timeout=10)
        s.setblocking(False)
        socks.append(s)
    start, closed = time.monotonic(), set()
    while len(closed) < num and time.monotonic() - start < 120:
        for i, s in enumerate(socks):
            if i in closed:
                continue
            try:
                if s.recv(1) == b"":
                    closed.add(i)
            except BlockingIOError:
                pass
            except OSError:
                closed.add(i)
        time.sleep(0.2)
    for s in socks:
        s.close()
    row(
        f"7 {num} idle TCP connections to the REST port",
        "3,000 stayed open (gateway +68 MB, 3,016 open files)",
        f"{len(closed)} closed by the gateway within {time.monotonic() - start:.1f} s",
    )


# -- 3: SIGTERM under 16 streams ---------------------------------------------------------------
async def sigterm(ports: Ports, up: subprocess.Popen, max_tokens: int) -> None:
    stub = generation_pb2_grpc.GenerationStub(grpc.aio.insecure_channel(f"127.0.0.1:{ports.grpc}"))
    long = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = [asyncio.Event() for _ in range(16)]

    async def one(i: int) -> str:
        reason = 0
        try:
            async for m in stub.Generate(
                generation_pb2.GenerateRequest(text=f"def f{i}(n):", sampling=long), timeout=300
            ):
                started[i].set()
                reason = m.finish_reason or reason
        except grpc.aio.AioRpcError as exc:
            started[i].set()
            return outcome_of(exc)[:50]
        return common_pb2.FinishReason.Name(reason)

    tasks = [asyncio.create_task(one(i)) for i in range(16)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
    os.kill(up.pid, signal.SIGTERM)
    start = time.monotonic()
    ends = await asyncio.gather(*tasks)
    code = await asyncio.to_thread(up.wait, 120)
    finished = sum(e == "FINISH_REASON_LENGTH" for e in ends)
    others = sorted({e for e in ends if e != "FINISH_REASON_LENGTH"})
    row(
        "3 SIGTERM to up under 16 streams",
        "7 'no decode instance has room' in 1-3 s, 9 cut at 10.3 s",
        f"{finished}/16 finished all {max_tokens} tokens{' (' + '; '.join(others) + ')' if others else ''}; "
        f"up exited {code} {time.monotonic() - start:.1f} s after SIGTERM",
    )


STEPS = ("crash", "text", "burst", "collision", "forged", "idle", "sigterm")


async def run(args, ports: Ports, up: subprocess.Popen, http: str) -> dict:
    steps, ended = args.steps.split(","), {}
    if "crash" in steps:
        await forged_first_token(ports, http)
    if "text" in steps:
        await huge_text(ports, http, 20_000_000)
        await huge_text(ports, http, 1_000_000)
    if "burst" in steps:
        ended = await burst(ports, http, args.streams, args.burst_max_tokens, os.path.join(args.log_dir, "up.log"))
    if "collision" in steps:
        await collision(ports, args.log_dir)
    if "forged" in steps:
        await forged_calls(ports)
    if "idle" in steps:
        await asyncio.to_thread(idle_connections, ports, args.idle)
    if "sigterm" in steps:
        await sigterm(ports, up, args.sigterm_max_tokens)
    return ended


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=3000)
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument(
        "--burst-max-tokens",
        type=int,
        default=1,
        help="of each burst stream; 1 = answered by the prefill alone (the burst is about the gateway), more = "
        "through a decode too",
    )
    ap.add_argument("--json", default="")
    ap.add_argument(
        "--sigterm-max-tokens", type=int, default=32, help="of the 16 streams; they must fit the 30 s drain grace"
    )
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {', '.join(STEPS)}")
    ap.add_argument("--log-dir", default="/tmp/splitserve-adversarial")
    ap.add_argument("up_flags", nargs="*", help="after --: more `splitserve up` flags")
    args = ap.parse_args()
    os.makedirs(args.log_dir, exist_ok=True)
    ports = Ports()
    http = f"http://127.0.0.1:{ports.http}"
    up = start_up(ports, args.up_flags, os.path.join(args.log_dir, "up.log"))
    try:
        print(f"up ready in {wait_ready(http):.1f} s (logs: {args.log_dir})", flush=True)
        ended = asyncio.run(run(args, ports, up, http))
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGTERM)
            up.wait(120)
    print("\n| finding | before (issue 22) | now |\n|---|---|---|")
    for finding, before, now in ROWS:
        print(f"| {finding} | {before} | {now} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": ROWS, "streams": ended}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
