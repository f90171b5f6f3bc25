"""Parity with vLLM beyond the answers' text: one model directory served by `splitserve serve` and by vLLM's
OpenAI server (CPU build, its own venv), both with `--enable-auto-tool-choice --tool-call-parser hermes`, the
same requests to both; per request kind: the response's shape (every non-null field, ids reduced to their
pattern, times to a type), the values (text, finish_reason, usage, tool calls, status), for streams the
sequence of event kinds and the folded answer, for errors status + type + param + code, and the `/metrics`
families (names, types, labels) after the same traffic. A benchmark, not a test; the sibling of
parity_vllm.py (which compares texts and logprobs of many greedy requests).

    python benchmarks/parity_vllm_api.py [--model DIR] [--vllm-python /work/vllm-venv/bin/python] [--json out.json]
        [--vllm-env VLLM_ENFORCE_STRICT_TOOL_CALLING=0]

Every request is greedy with a fixed max_tokens. The servers run one after the other (ours, then vLLM's).
Each known difference names the test that asserts ours and why it differs (parity_vllm_cases.KNOWN); the
table lists every other difference as undocumented.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from parity_vllm import CHILD_ENV, MAX_MODEL_LEN, NAME, Server, free_port
from parity_vllm_cases import KNOWN, Case, cases

# --- servers ------------------------------------------------------------------------------------------------

TOOL_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
VLLM_CPU_BLOCK_SIZE = 128  # vLLM's CPU default: ours uses it here so that prefix-cache hit counts compare


def start_ours(model: str, logs: Path) -> tuple[Server, list[str]]:
    """`splitserve serve` with vLLM's flags; the prefill's /metrics on a free port, the decode's on the next."""
    http, metrics = free_port(), free_port()
    argv = [sys.executable, "-m", "splitserve.cli", "serve", model, "--dtype", "float32", "--device", "cpu"]
    argv += ["--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", NAME, "--port", str(http), *TOOL_FLAGS]
    argv += ["--metrics-ports", str(metrics), "--block-size", str(VLLM_CPU_BLOCK_SIZE)]
    for flag in ("--grpc-port", "--prefill-port", "--decode-port"):
        argv += [flag, str(free_port())]
    log = logs / "splitserve.log"
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=CHILD_ENV, start_new_session=True)
    base = f"http://127.0.0.1:{http}"
    urls = [f"{base}/metrics", f"http://127.0.0.1:{metrics}/metrics", f"http://127.0.0.1:{metrics + 1}/metrics"]
    return Server("splitserve", proc, base + "/v1", log), urls


def start_vllm(model: str, python: str, logs: Path, env: dict[str, str]) -> tuple[Server, list[str]]:
    port = free_port()
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32"]
    argv += ["--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--port", str(port), "--served-model-name", NAME]
    argv += TOOL_FLAGS
    child_env = {**CHILD_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1", **env}
    log = logs / "vllm.log"
    proc = subprocess.Popen(
        argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=child_env, cwd=logs, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    return Server("vllm", proc, base + "/v1", log), [f"{base}/metrics"]


# --- one request --------------------------------------------------------------------------------------------

_ID_KEY = re.compile(r"(^|_)id$")
_TIME_KEYS = {"created", "created_at", "completed_at"}


def normal(value: Any, key: str = "") -> Any:
    """The answer with null fields dropped, ids reduced to their pattern (hex runs -> <hex>), times -> <time>."""
    if isinstance(value, dict):
        return {k: normal(v, k) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [normal(v, key) for v in value]
    if key in _TIME_KEYS and isinstance(value, (int, float)):
        return "<time>"
    if _ID_KEY.search(key) and isinstance(value, str):
        return re.sub(r"[0-9a-f]{8,}", "<hex>", value)
    return value


def sse_events(lines: list[str]) -> list[dict]:
    """The `data:` payloads of an SSE stream ([DONE] as {"done": true}), each with its `event:` name if any."""
    out, event = [], None
    for line in lines:
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
            payload = {"done": True} if data == "[DONE]" else json.loads(data)
            if event is not None:
                payload = {"event": event, **payload}
            out.append(payload)
            event = None
    return out


def event_kind(event: dict) -> str:
    """A short name of what one event carries: the Responses event type, or for a chat / completion chunk its
    delta's fields (role, content, tool name, arguments), finish and usage."""
    if "done" in event:
        return "[DONE]"
    if "type" in event:
        return event["type"]
    parts = []
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("role"):
            parts.append("role")
        if delta.get("content") or choice.get("text"):
            parts.append("content")
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            parts += ["tool.name"] if function.get("name") else []
            parts += ["tool.args"] if function.get("arguments") else []
        if choice.get("finish_reason"):
            parts.append(f"finish={choice['finish_reason']}")
    if event.get("usage"):
        parts.append("usage")
    return "+".join(parts) or "empty"


def runs(kinds: list[str]) -> list[str]:
    """Consecutive repeats collapsed (token boundaries may differ where the texts are equal)."""
    return [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]


def fold(events: list[dict]) -> dict:
    """A chat / completion stream folded into one answer per choice: text, tool calls, finish; the usage."""
    choices: dict[int, dict] = {}
    usage = None
    for event in events:
        usage = event.get("usage") or usage
        for c in event.get("choices") or []:
            slot = choices.setdefault(c["index"], {"text": "", "tool_calls": {}, "finish_reason": None})
            delta = c.get("delta") or {}
            slot["text"] += delta.get("content") or c.get("text") or ""
            for call in delta.get("tool_calls") or []:
                one = slot["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                function = call.get("function") or {}
                one["name"] += function.get("name") or ""
                one["arguments"] += function.get("arguments") or ""
            slot["finish_reason"] = c.get("finish_reason") or slot["finish_reason"]
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}


def responses_fold(events: list[dict]) -> Any:
    """A Responses stream: the final response object (response.completed / .incomplete)."""
    finals = [e["response"] for e in events if e.get("type") in ("response.completed", "response.incomplete")]
    return normal(finals[-1]) if finals else None


def without_message(answer: dict) -> dict:
    """An error's message is each server's own words: status, type, param and code are compared."""
    error = (answer.get("body") or {}).get("error") if isinstance(answer.get("body"), dict) else None
    if isinstance(error, dict):
        return {**answer, "body": {**answer["body"], "error": {k: v for k, v in error.items() if k != "message"}}}
    return answer


def send(base: str, case: Case) -> dict:
    """One request -> {"status", "body"} (non-streamed) or {"status", "kinds", "folded", "chunk_fields"}."""
    url = base.removesuffix("/v1") + case.path
    if case.method == "GET":
        r = httpx.get(url, timeout=600)
        return {"status": r.status_code, "body": normal(r.json())}
    body = case.body if case.raw is None else None
    if not case.stream:
        content = case.raw.encode() if case.raw is not None else None
        headers = {"content-type": "application/json"} if content is not None else None
        r = httpx.post(url, json=body, content=content, headers=headers, timeout=600)
        return {"status": r.status_code, "body": normal(r.json())}
    with httpx.stream("POST", url, json=body, timeout=600) as r:
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code, "body": normal(r.json())}
        events = sse_events(list(r.iter_lines()))
    folded = responses_fold(events) if case.path == "/v1/responses" else normal(fold(events))
    fields = {path: "present" for e in events if "done" not in e for path in sorted(shape(normal(e)))}
    return {"status": 200, "kinds": runs([event_kind(e) for e in events]), "folded": folded, "event_fields": fields}


def shape(value: Any, path: str = "") -> set[str]:
    """Every field path with a non-null value, lists as []."""
    if isinstance(value, dict):
        out = {path} if not value else set()
        for k, v in value.items():
            out |= shape(v, f"{path}.{k}")
        return out
    if isinstance(value, list):
        out = {f"{path}[]"} if not value else set()
        for v in value:
            out |= shape(v, f"{path}[]")
        return out
    return {path}


# --- comparing ----------------------------------------------------------------------------------------------


def differences(a: Any, b: Any, path: str = "", limit: int = 12) -> list[str]:
    """Every path where ours (a) and vLLM's (b) differ, as `path: ours != vllm` (fields only one side has say
    <absent>)."""
    out: list[str] = []
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                side = "<absent>"
                out.append(f"{path}.{k}: {short(a.get(k, side))} != {short(b.get(k, side))}")
            else:
                out += differences(a[k], b[k], f"{path}.{k}", limit)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            out += differences(x, y, f"{path}[{i}]", limit)
    elif a != b:
        out.append(f"{path or '.'}: {short(a)} != {short(b)}")
    return out[:limit]


def short(value: Any) -> str:
    return value if isinstance(value, str) and value == "<absent>" else json.dumps(value)[:80]


def compare_metrics(ours: list[str], theirs: list[str]) -> tuple[list[str], dict]:
    """vLLM's `vllm:` families vs the union of our processes': names with types, label names."""
    mine, vllm = families(ours), families(theirs)
    found = []
    for name in sorted(set(mine) | set(vllm)):
        if name not in mine:
            found.append(f"{name}: <absent> != {vllm[name][0]}")
        elif name not in vllm:
            found.append(f"{name}: {mine[name][0]} != <absent>")
        elif mine[name] != vllm[name]:
            found.append(f"{name}: {mine[name]} != {vllm[name]}")
    return found, {"ours": mine, "vllm": vllm}


def families(texts: list[str]) -> dict[str, tuple[str, list[str]]]:
    """`vllm:` family -> (type, sorted label names) over every exposition given (the _created series left out:
    prometheus_client's, not a family of their own)."""
    types: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    for text in texts:
        for line in text.splitlines():
            if line.startswith("# TYPE vllm:") and not line.split()[2].endswith("_created"):
                _, _, name, kind = line.split()
                types[name] = kind
                labels.setdefault(name, set())
            elif line.startswith("vllm:") and "{" in line:
                sample = line.split("{", 1)[0]
                owners = [n for n in types if sample == n or sample.startswith(n + "_")]
                family = max(owners, key=len, default=None)  # num_requests_waiting_by_reason is not ..._waiting
                if family is not None:
                    keys = re.findall(r'([a-zA-Z_]+)="', line.split("{", 1)[1])
                    labels[family] |= {k for k in keys if k not in ("le", "quantile")}
    return {n: (types[n], sorted(labels[n])) for n in sorted(types)}


def classify(kind: str, found: list[str]) -> tuple[list[str], list[str]]:
    """(differences no KNOWN entry covers, the KNOWN entries that covered the others); an entry's pattern is
    searched in "KIND | PATH: OURS != VLLM"."""
    left, hit = [], []
    for difference in found:
        entry = next((k for k in KNOWN if re.search(k, f"{kind} | {difference}")), None)
        if entry is None:
            left.append(difference)
        elif entry not in hit:
            hit.append(entry)
    return left, hit


def run_server(server: Server, metrics_urls: list[str], all_cases: list[Case], timeout_s: float) -> dict:
    ready_s = server.wait_ready(timeout_s)
    return {"ready_s": ready_s, **ask(server.base_url, metrics_urls, all_cases)}


def ask(base_url: str, metrics_urls: list[str], all_cases: list[Case]) -> dict:
    """Every case's answer, then every /metrics text."""
    answers = {case.kind: send(base_url, case) for case in all_cases}
    return {"answers": answers, "metrics": [httpx.get(url, timeout=30).text for url in metrics_urls]}


def table(details: list[dict]) -> str:
    """One row per kind: equal, equal but for known differences (their numbers in the second table), or
    differs (the differences no test documents)."""
    width = max(len(d["kind"]) for d in details)
    numbers = {k: i + 1 for i, k in enumerate(KNOWN)}
    lines = [f"| {'request kind':<{width}} | result | known (below) | undocumented differences (ours != vLLM) |"]
    lines.append(f"|{'-' * (width + 2)}|---|---|---|")
    for d in details:
        result = "differs" if d["undocumented"] else "equal" if not d["known"] else "known"
        known = ",".join(str(numbers[k]) for k in d["known"])
        lines.append(f"| {d['kind']:<{width}} | {result} | {known} | {'; '.join(d['undocumented'])[:400]} |")
    lines += ["", "| # | known difference (pattern) | why, and the test that asserts ours |", "|---|---|---|"]
    for k, i in numbers.items():
        if any(k in d["known"] for d in details):
            lines.append(f"| {i} | `{k}` | {KNOWN[k]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="model directory; default: the embedded default model")
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python", help="python of vLLM's venv")
    parser.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE", help="more env for vLLM")
    parser.add_argument("--json", default="", help="write the comparison here")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    for who in ("ours", "vllm"):
        parser.add_argument(
            f"--{who}-urls",
            default="",
            help=f"{who}: a server already running, as BASE,METRICS_URL[,METRICS_URL...] (none is started)",
        )
    args = parser.parse_args(argv)
    if not args.model:
        from splitserve.common.default_model_path import default_model_path

        args.model = str(default_model_path())
    all_cases = cases()
    logs = Path(tempfile.mkdtemp(prefix="parity-vllm-api-"))
    vllm_env = dict(item.split("=", 1) for item in args.vllm_env)
    results = {}
    starts = [("ours", lambda: start_ours(args.model, logs))]
    starts.append(("vllm", lambda: start_vllm(args.model, args.vllm_python, logs, vllm_env)))
    for name, start in starts:
        attached = getattr(args, f"{name}_urls")
        if attached:
            base, *urls = attached.split(",")
            results[name] = {"ready_s": 0.0, **ask(base, urls, all_cases)}
            continue
        server, urls = start()
        try:
            t0 = time.monotonic()
            results[name] = run_server(server, urls, all_cases, args.ready_timeout_s)
            took_s = time.monotonic() - t0 - results[name]["ready_s"]
            print(f"{name}: ready in {results[name]['ready_s']:.0f} s, requests in {took_s:.0f} s", file=sys.stderr)
        finally:
            server.stop()
    details = []
    for case in all_cases:
        a, b = results["ours"]["answers"][case.kind], results["vllm"]["answers"][case.kind]
        found = differences(without_message(a), without_message(b), limit=40)
        left, hit = classify(case.kind, found)
        details.append({"kind": case.kind, "undocumented": left, "known": hit, "ours": a, "vllm": b})
    found, fams = compare_metrics(results["ours"]["metrics"], results["vllm"]["metrics"])
    left, hit = classify("/metrics", found)
    details.append({"kind": "/metrics vllm: families", "undocumented": left, "known": hit, **fams})
    print(table(details))
    equal = sum(not d["undocumented"] for d in details)
    print(
        f"\n{equal} of {len(details)} kinds equal or differ only as documented (model {args.model}, vLLM env "
        f"{vllm_env or 'default'}, logs in {logs})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "vllm_env": vllm_env, "kinds": details}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
