"""The gateway's resident memory around one large non-streamed REST answer: the real gateway process in front of
the fake prefill and decode of gateway_cost.py (instant prefill, a token per sequence every --step-ms), one
completions request of a batch of prompts x n sequences x max_tokens with top logprobs. Reports the gateway's
RSS before, at its peak while answering, just after and a few seconds after, the answer's size and time.

    python benchmarks/rest_answer_memory.py --prompts 8 --n 16 --max-tokens 500 --logprobs 5 --json out.json

A gateway that builds the answer whole holds it several times over (the choices as dicts, then the text, then
the bytes) at its peak and may keep the pages after; one that writes it in parts holds about its bytes once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from gateway_cost import CHILD_ENV, wait_ready

from splitserve.bench.serve_launch import free_port


def rss_mb(pid: int) -> float:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def start_stack(
    tmp: str, step_ms: float, max_answer_entries: int, max_request_tokens: int
) -> tuple[subprocess.Popen, subprocess.Popen, int]:
    tok = os.path.join(tmp, "tokenizer")
    fakes = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("gateway_cost.py")), "--role", "fakes"]
        + ["--step-ms", str(step_ms), "--tokenizer-dir", tok],
        env=CHILD_ENV,
        stdout=subprocess.PIPE,
        text=True,
    )
    prefill, decode = fakes.stdout.readline().split()
    http_port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", "gateway", "--grpc-port", str(free_port())]
        + ["--http-port", str(http_port), "--prefill", prefill, "--decode", decode, "--model", tok]
        + ["--max-answer-entries", str(max_answer_entries), "--max-request-tokens", str(max_request_tokens)],
        env=CHILD_ENV,
        stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(tmp, "gateway.log"), "w"),
    )
    wait_ready(http_port)
    return fakes, gateway, http_port


def answer_once(http_port: int, gateway_pid: int, body: dict) -> dict:
    import httpx

    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb(gateway_pid))
            time.sleep(0.01)

    before = rss_mb(gateway_pid)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=600)
    took = time.perf_counter() - start
    done.set()
    sampler.join()
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
    after = rss_mb(gateway_pid)
    time.sleep(3.0)
    return {
        "answer_mb": len(r.content) / 2**20,
        "seconds": took,
        "rss_before_mb": before,
        "rss_peak_mb": max(peak[0], after),
        "rss_after_mb": after,
        "rss_after_3s_mb": rss_mb(gateway_pid),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=500)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=2, help="answers in a row (the first warms the gateway up)")
    ap.add_argument("--step-ms", type=float, default=1.0, help="the fake decode's step")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    body = {
        "model": "tok",
        "prompt": [f"hello world w{20 + i}" for i in range(args.prompts)],
        "n": args.n,
        "max_tokens": args.max_tokens,
        "logprobs": args.logprobs,
        "temperature": 0,
    }
    entries = args.prompts * args.n * (args.max_tokens + 8) * (1 + args.logprobs)
    with tempfile.TemporaryDirectory() as tmp:
        tokens = args.prompts * args.n * (args.max_tokens + 64)
        fakes, gateway, http_port = start_stack(tmp, args.step_ms, max(entries * 2, 1 << 20), max(tokens, 1 << 17))
        try:
            import httpx

            body["model"] = httpx.get(f"http://127.0.0.1:{http_port}/v1/models").json()["data"][0]["id"]
            runs = [answer_once(http_port, gateway.pid, body) for _ in range(args.repeat)]
        finally:
            for proc in (gateway, fakes):
                proc.kill()
                proc.wait()
    print(f"{args.prompts} prompts x n {args.n} x {args.max_tokens} tokens, logprobs {args.logprobs}")
    print(f"{'run':>4} {'answer MB':>10} {'s':>6} {'RSS before':>11} {'peak':>8} {'after':>8} {'after 3 s':>10}")
    for i, r in enumerate(runs):
        print(
            f"{i:>4} {r['answer_mb']:>10.1f} {r['seconds']:>6.1f} {r['rss_before_mb']:>11.0f} {r['rss_peak_mb']:>8.0f} "
            f"{r['rss_after_mb']:>8.0f} {r['rss_after_3s_mb']:>10.0f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
