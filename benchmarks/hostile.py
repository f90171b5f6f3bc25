"""The hostile clients' attacks replayed against a CPU `splitserve up`, while another caller measures what it sees.

    python benchmarks/hostile.py [--only 1,4,9] [--json hostile.json]

Starts `splitserve up --device cpu` (the embedded default model, one prefill and one decode over shm, the gateway)
with an API-keys file, then replays each finding of the adversarial run, scaled to a few minutes on 2 cores:

1. specs that compile but admit no token (guided_json $ref loops, a $defs self-loop, grammar root ::= root, a
   regex with an empty class), each sent twice: 400s, no core exits
2. a 16,000-property schema (past the compile budget) whose client leaves after 3 s, then a tiny guided_choice
3. eight (--enum-schemas) distinct 9,000-string enum schemas (20-26 MiB of grammar each): the cores' memory stays
   bounded
4. the 1.55 GB answer's body (64 prompts x 1,023 ids, prompt_logprobs 20, n 16), then an allowed large
   non-streamed answer with logprobs 20: the gateway's memory before and after
5. 150 clients with 900-token prompts that leave after 0.3 s, then a normal request
6. the 204,800-token body (64 prompts x n 16 x 200 tokens), then an allowed ~100k-token one from one caller (key)
   while another caller sends three 8-token requests, then its client leaves
7. an API key holding '#': the whole key 200, its prefix before '#' 401
8. the prefill's engine core stopped (SIGSTOP) for 16 s: /ready, and new requests served meanwhile
9. a 1.04 MB gRPC Tokenize; requests right after the decode's core is killed (503 while it restarts, never 500)

Meanwhile a steady caller streams 64-token completions one after another (the gap between its tokens, and from
a request's start to its first token, is what "other callers" see) and polls /health every 0.2 s. For each
finding: the status codes, what happened, the largest gap and /health time, and each process's RSS before and
after (a pid that changed is a restart). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
from up_load import UpProcess, Variant, log_problems, process_roles

from splitserve.bench.serve_launch import HOST

# callers by API key (the fair share is per key): the steady other caller, the attacker, a third caller's small
# requests (finding 6), and the key holding '#'
KEY, ATTACKER, THIRD, HASH_KEY = "hostile-other-caller", "hostile-attacker", "hostile-third-caller", "hostile#key-1"
ROLES = ("up", "gateway", "prefill", "prefill-core", "decode", "decode-core")


def rss_mb(pid: int) -> float | None:
    try:
        return round(int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except OSError:
        return None


class Others:
    """The other callers: a stream of 64-token completions one after another, and /health every 0.2 s."""

    def __init__(self, base: str) -> None:
        self.base, self.stop = base, threading.Event()
        self.arrivals: list[float] = []  # a request's start and each of its events, time.monotonic()
        self.health: list[tuple[float, float]] = []  # (start, seconds)
        self.errors: Counter = Counter()
        self.threads = [threading.Thread(target=self._stream), threading.Thread(target=self._health)]
        for thread in self.threads:
            thread.start()

    def _stream(self) -> None:
        body = {"prompt": "the other caller", "max_tokens": 64, "ignore_eos": True, "stream": True}
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=self.base, timeout=120, headers=headers) as client:
            while not self.stop.is_set():
                self.arrivals.append(time.monotonic())
                try:
                    with client.stream("POST", "/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            self.errors[r.status_code] += 1
                            time.sleep(0.2)
                            continue
                        for line in r.iter_lines():
                            if line.startswith("data: "):
                                self.arrivals.append(time.monotonic())
                except httpx.HTTPError as exc:
                    self.errors[type(exc).__name__] += 1
                    time.sleep(0.2)

    def _health(self) -> None:
        with httpx.Client(base_url=self.base, timeout=60) as client:
            while not self.stop.is_set():
                start = time.monotonic()
                try:
                    client.get("/health")
                except httpx.HTTPError:
                    pass
                self.health.append((start, time.monotonic() - start))
                time.sleep(0.2)

    def window(self, start: float, end: float) -> dict:
        """The largest gap between the stream's arrivals that overlaps [start, end] (a gap still open at `end`
        counts up to `end`), and the slowest /health that began in it."""
        points = [t for t in self.arrivals if t >= start - 60]
        gaps = [(b - a, a) for a, b in zip(points, points[1:]) if b >= start and a <= end]
        if points and points[-1] < end:
            gaps.append((end - max(points[-1], start), max(points[-1], start)))
        gap, at = max(gaps, default=(0.0, start))
        health = [s for t, s in self.health if start <= t <= end]
        return {
            "max_gap_s": round(gap, 3),
            "max_gap_from_s": round(at - start, 1),  # when it began, from the finding's start
            "max_health_s": round(max(health, default=0.0), 3),
        }

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(130)


def post(base: str, path: str, body: dict, key: str = ATTACKER, timeout: float = 600) -> httpx.Response:
    return httpx.post(base + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)


def timed(base: str, body: dict, key: str = ATTACKER) -> tuple[int, float]:
    start = time.monotonic()
    r = post(base, "/v1/completions", body, key=key)
    return r.status_code, round(time.monotonic() - start, 2)


SMALL = {"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 8, "ignore_eos": True}


def no_token_specs(base: str) -> dict:
    loop = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    specs = [
        {"guided_json": {"$ref": "#"}},
        {"guided_json": {"allOf": [{"$ref": "#"}]}},
        {"guided_json": loop},
        {"guided_grammar": "root ::= root"},
        {"guided_regex": "a[^\\s\\S]"},
    ]
    codes, took = [], []
    for spec in specs * 2:
        start = time.monotonic()
        codes.append(post(base, "/v1/completions", {"prompt": "x", "max_tokens": 8, **spec}).status_code)
        took.append(f"{time.monotonic() - start:.1f}")
    # the regex admits "a", then nothing: its request ends alone with an error (a 500) after its first token
    outcome = f"{codes.count(400)} of {len(codes)} refused 400, the dead-end regex's {codes[4::5]}; s: {took}"
    return {"codes": codes, "outcome": outcome}


def slow_schema(num_properties: int) -> dict:
    props = {
        f"p{k}": {"type": ("string", "integer", "boolean")[k % 3]}
        | ({"pattern": f"[a-z]{{2,{k % 9 + 3}}}"} if k % 3 == 0 else {})
        for k in range(num_properties)
    }
    return {"type": "object", "properties": props, "required": list(props)}


def abandoned_compile(base: str) -> dict:
    body = {"prompt": "x", "max_tokens": 8, "guided_json": slow_schema(16_000)}
    try:
        code = post(base, "/v1/completions", body, timeout=3).status_code
    except httpx.ReadTimeout:
        code = "left"
    tiny_code, tiny_s = timed(base, {"prompt": "yes or no?", "max_tokens": 4, "guided_choice": ["yes", "no"]})
    return {"codes": [code, tiny_code], "outcome": f"guided_choice after it: {tiny_code} in {tiny_s} s"}


def enum_schemas(base: str, pids: dict[str, int], count: int) -> dict:
    """`count` distinct enum schemas, one after another; the cores' RSS after every eighth shows whether the grammar
    cache (--structured-output-cache-mb) stops the growth once it is full."""
    codes, took, cores = [], [], []
    for tag in range(count):
        # 9,000 strings: 125 KB, under the 128 KiB spec limit (12,000, the finding's 108 KB of shorter strings, is over)
        schema = {"enum": [f"{tag}-{k}-" + "abcdefghij"[k % 10] * (k % 7) for k in range(9_000)]}
        start = time.monotonic()
        codes.append(post(base, "/v1/completions", {"prompt": "x", "max_tokens": 2, "guided_json": schema}).status_code)
        took.append(time.monotonic() - start)
        if (tag + 1) % 8 == 0:
            cores.append("/".join(f"{rss_mb(pids[role]) or 0:.0f}" for role in ("prefill-core", "decode-core")))
    outcome = f"each {min(took):.1f}-{max(took):.1f} s; prefill/decode core MB after every 8: {', '.join(cores)}"
    return {"codes": codes, "outcome": outcome}


def large_answer(base: str) -> dict:
    rng = random.Random(4)
    huge = {
        "prompt": [[rng.randrange(3, 8192) for _ in range(1023)] for _ in range(64)],
        "max_tokens": 1,
        "n": 16,
        "prompt_logprobs": 20,
    }
    refused = post(base, "/v1/completions", huge)
    allowed = {"prompt": ["w1 w2 w3", "w4 w5 w6"], "n": 4, "max_tokens": 256, "logprobs": 20, "ignore_eos": True}
    start = time.monotonic()
    r = post(base, "/v1/completions", allowed)
    took = time.monotonic() - start
    size_mb = len(r.content) / 2**20
    outcome = f"refused: {refused.json()['error']['param']}; allowed: {size_mb:.1f} MB, {took:.1f} s"
    return {"codes": [refused.status_code, r.status_code], "outcome": outcome}


async def _leave_early(base: str, prompts: list[list[int]]) -> Counter:
    limits = httpx.Limits(max_connections=len(prompts))
    headers = {"Authorization": f"Bearer {ATTACKER}"}
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(30.0, read=0.3), headers=headers) as client:

        async def one(prompt):
            try:
                r = await client.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 16})
                return r.status_code
            except httpx.ReadTimeout:
                return "left"

        return Counter(await asyncio.gather(*(one(p) for p in prompts)))


def clients_that_leave(base: str) -> dict:
    rng = random.Random(7)
    ended = asyncio.run(_leave_early(base, [[rng.randrange(3, 8192) for _ in range(900)] for _ in range(150)]))
    code, took = timed(base, SMALL)
    return {"codes": dict(ended) | {"next": code}, "outcome": f"the next request: {code} in {took} s"}


def one_request_owns(base: str) -> dict:
    rng = random.Random(11)
    refused = post(base, "/v1/completions", {"prompt": [[5] * 8] * 64, "n": 16, "max_tokens": 200})
    big = {"prompt": [[rng.randrange(3, 8192) for _ in range(8)] for _ in range(32)], "n": 16, "max_tokens": 200}
    big["ignore_eos"] = True

    async def run() -> list:
        headers = {"Authorization": f"Bearer {ATTACKER}"}
        async with httpx.AsyncClient(timeout=600, headers=headers) as client:
            task = asyncio.ensure_future(client.post(base + "/v1/completions", json=big))
            await asyncio.sleep(3.0)  # its sequences decoding (a benchmark: no condition to wait on here)
            small = [await asyncio.to_thread(timed, base, SMALL, THIRD) for _ in range(3)]
            still = not task.done()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return [small, still]

    small, still = asyncio.run(run())
    outcome = f"8-token requests: {', '.join(f'{s} s' for _, s in small)}; the big one still ran: {still}"
    return {"codes": [refused.status_code, *(c for c, _ in small)], "outcome": outcome}


def hash_key(base: str) -> dict:
    codes = []
    for key in (HASH_KEY, HASH_KEY.split("#")[0]):
        codes.append(httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code)
        codes.append(post(base, "/v1/completions", SMALL, key=key).status_code)
    return {"codes": codes, "outcome": "whole key: models, completions; prefix: models, completions"}


def hung_prefill(base: str, pids: dict) -> dict:
    core = pids["prefill-core"]
    os.kill(core, signal.SIGSTOP)
    results, ready = [], []
    try:
        start = time.monotonic()
        for at in (0.5, 6.0, 12.0):
            time.sleep(max(0.0, start + at - time.monotonic()))
            ready.append(httpx.get(base + "/ready", timeout=30).json().get("ready"))
            results.append(timed(base, SMALL))
        time.sleep(max(0.0, start + 16 - time.monotonic()))
    finally:
        os.kill(core, signal.SIGCONT)
    outcome = "; ".join(f"/ready {r}, request {c} in {s} s" for r, (c, s) in zip(ready, results))
    return {"codes": [c for c, _ in results], "outcome": outcome}


def tokenize_and_decode_kill(base: str, grpc_port: int, pids: dict) -> dict:
    import grpc

    from splitserve.protos import generation_pb2, generation_pb2_grpc

    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"{HOST}:{grpc_port}"))
    start = time.monotonic()
    metadata = (("authorization", f"Bearer {ATTACKER}"),)
    ids = stub.Tokenize(generation_pb2.TokenizeRequest(text="w1 " * 346_000), timeout=120, metadata=metadata)
    tokenize_s = time.monotonic() - start
    os.kill(pids["decode-core"], signal.SIGKILL)
    answers = [post(base, "/v1/completions", SMALL, timeout=60) for _ in range(6)]
    codes = [r.status_code for r in answers]
    errors = sorted({r.text[:160] for r in answers if r.status_code == 500})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not httpx.get(base + "/ready", timeout=10).json().get("ready"):
        time.sleep(0.5)
    codes.append(timed(base, SMALL)[0])
    outcome = f"Tokenize {len(ids.token_ids)} ids in {tokenize_s:.1f} s; after the kill: {codes}; 500s: {errors}"
    return {"codes": codes, "outcome": outcome}


NUM_ENUM_SCHEMAS = 8  # finding 3 (--enum-schemas)
FINDINGS = {
    1: ("specs that admit no token", lambda up, pids: no_token_specs(up.base)),
    2: ("an abandoned 16k-property compile", lambda up, pids: abandoned_compile(up.base)),
    3: ("enum schemas of 125 KB (grammar cache)", lambda up, pids: enum_schemas(up.base, pids, NUM_ENUM_SCHEMAS)),
    4: ("a 1.55 GB answer's body; a large answer", lambda up, pids: large_answer(up.base)),
    5: ("150 clients leave before a token", lambda up, pids: clients_that_leave(up.base)),
    6: ("one caller's 100k-token request", lambda up, pids: one_request_owns(up.base)),
    7: ("an API key holding '#'", lambda up, pids: hash_key(up.base)),
    8: ("the prefill core stopped 16 s", lambda up, pids: hung_prefill(up.base, pids)),
    9: ("1 MB Tokenize; decode core killed", lambda up, pids: tokenize_and_decode_kill(up.base, up.grpc_port, pids)),
}


def replay(up: UpProcess, others: Others, number: int) -> dict:
    name, attack = FINDINGS[number]
    pids = process_roles(up.proc.pid)
    before = {role: rss_mb(pid) for role, pid in pids.items()}
    log_offset = up.log_path.stat().st_size
    start = time.monotonic()
    try:
        result = attack(up, pids)
    except Exception as exc:  # a finding that broke the benchmark's own client is a row too
        result = {"codes": [], "outcome": f"failed: {type(exc).__name__}: {str(exc)[:200]}"}
    end = time.monotonic()
    time.sleep(2.0)  # the processes settle (freed memory, aborted work) before their RSS is read
    after_pids = process_roles(up.proc.pid) if up.proc.poll() is None else {}
    after = {role: rss_mb(pid) for role, pid in after_pids.items()}
    restarted = sorted(role for role in ROLES if pids.get(role) != after_pids.get(role))
    result["log_errors"] = {line: n for line, n in log_problems(up.log_path, log_offset)[0].items() if "ERROR" in line}
    row = {"finding": number, "name": name, "seconds": round(end - start, 1), **result, **others.window(start, end)}
    return row | {"restarted": restarted, "rss_before_mb": before, "rss_after_mb": after}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="1,2,3,4,5,6,7,8,9", help="findings to replay, in this order")
    ap.add_argument("--json", default="hostile.json")
    ap.add_argument(
        "--enum-schemas", type=int, default=8, help="finding 3: distinct schemas (40: past the cache's cap)"
    )
    args = ap.parse_args()
    global NUM_ENUM_SCHEMAS
    NUM_ENUM_SCHEMAS = args.enum_schemas
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text(f"# keys of the hostile benchmark\n{KEY}\n{ATTACKER}\n{THIRD}\n{HASH_KEY}\n")
        load = [round(x, 2) for x in os.getloadavg()]
        up = UpProcess(Variant("hostile", ("--api-keys-file", str(keys))), Path(tmp), ready_timeout_s=300)
        up.base = f"http://{HOST}:{up.http_port}"
        others = Others(up.base)
        rows = []
        try:
            time.sleep(3.0)  # the other caller's stream under way
            for number in (int(x) for x in args.only.split(",")):
                rows.append(replay(up, others, number))
                print_row(rows[-1])
        finally:
            others.close()
            up.stop()
        load.append([round(x, 2) for x in os.getloadavg()])
    print_table(rows, load, others.errors)
    Path(args.json).write_text(json.dumps({"load": load, "rows": rows, "other_errors": dict(others.errors)}, indent=1))


def print_row(row: dict) -> None:
    print(f"finding {row['finding']}: {row['outcome']} (codes {row['codes']})", flush=True)
    for line, count in row["log_errors"].items():
        print(f"    {count} x {line}", flush=True)


def print_table(rows: list[dict], load: list, errors: Counter) -> None:
    print(f"\nload average before {load[:3]}, after {load[3]}; the other caller's errors: {dict(errors) or 'none'}")
    print(f"{'#':>2} {'finding':<40} {'s':>6} {'max gap':>8} {'at':>6} {'/health':>8} {'restarted':<12} outcome")
    for r in rows:
        restarted = ",".join(r["restarted"]) or "-"
        print(
            f"{r['finding']:>2} {r['name']:<40} {r['seconds']:>6} {r['max_gap_s']:>8} {r['max_gap_from_s']:>6} "
            f"{r['max_health_s']:>8} "
            f"{restarted:<12} {r['outcome']} (codes {r['codes']})"
        )
    print(f"\nRSS MB before -> after each finding ({', '.join(ROLES)})")
    for r in rows:
        cells = [f"{r['rss_before_mb'].get(role)}->{r['rss_after_mb'].get(role)}" for role in ROLES]
        print(f"{r['finding']:>2} " + "  ".join(cells))


if __name__ == "__main__":
    main()
