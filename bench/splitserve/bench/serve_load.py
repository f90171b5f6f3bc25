"""Workload and load generation for splitserve bench serve: prompts, arrivals, the two clients, the runner.

Everything random comes from one seed: the same seed gives the same prompts, output lengths and
arrival times, so two setups measured with one seed see the same workload.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from splitserve.bench.serve_stats import CANCELLED, COMPLETED, FAILED, RequestRecord, token_gaps

LENGTH_DISTS = ("fixed", "uniform", "longtail")


def check_loopback(host: str) -> str:
    """`host` when it is 127.0.0.0/8, localhost or ::1; ValueError otherwise (no DNS lookups)."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if bare == "localhost":
        return host
    try:
        loopback = ipaddress.ip_address(bare).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(
            f"--host {host!r} is not a loopback address; splitserve bench serve only sends load to "
            "127.0.0.0/8, localhost or ::1"
        )
    return host


def url_host(host: str) -> str:
    """`host` as it goes into a URL or a gRPC target (IPv6 in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


@dataclass(frozen=True)
class LengthDist:
    """Token lengths: fixed at `mean`, uniform in mean·[1-spread, 1+spread], or a lognormal long tail
    with median `mean` and sigma `spread` (ShareGPT-like: most short, a few very long)."""

    kind: str
    mean: int
    spread: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_DISTS:
            raise ValueError(f"length distribution must be one of {', '.join(LENGTH_DISTS)}, got {self.kind!r}")
        if self.mean < 1:
            raise ValueError(f"length must be >= 1, got {self.mean}")
        if self.spread < 0 or (self.kind == "uniform" and self.spread >= 1):
            raise ValueError(
                f"{self.kind} spread must be in [0, 1) for uniform and >= 0 for longtail, got {self.spread}"
            )

    def sample(self, rng: random.Random, limit: int | None) -> int:
        """One length; longtail draws are clipped to [1, limit], other kinds must fit in limit."""
        if self.kind == "fixed":
            n = self.mean
        elif self.kind == "uniform":
            n = rng.randint(max(1, round(self.mean * (1 - self.spread))), round(self.mean * (1 + self.spread)))
        else:
            n = max(1, round(rng.lognormvariate(math.log(self.mean), self.spread)))
            return min(n, limit) if limit else n
        if limit is not None and n > limit:
            raise ValueError(
                f"a {self.kind} length of {n} tokens exceeds the {limit} allowed "
                "(context limit minus the output length); lower the length"
            )
        return n


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: prompt token ids and forced output length."""

    index: int
    prompt: tuple[int, ...]
    output_len: int


def make_workload(
    num_requests: int,
    prompts: LengthDist,
    outputs: LengthDist,
    vocab_size: int,
    max_model_len: int | None,
    seed: int,
    salt: int = 0,
) -> list[RequestSpec]:
    """Seeded random prompts (token ids in [1, vocab_size)) and output lengths; prompt + output fits
    in max_model_len. Lengths depend on `seed` only; token ids on `seed` and `salt`, so the runs of a
    sweep (one salt each) share lengths but never a prompt (no prefix-cache hits between runs)."""
    if vocab_size < 2:
        raise ValueError(f"--vocab-size must be >= 2, got {vocab_size}")
    lengths, ids = random.Random(seed), random.Random(f"prompt-ids/{seed}/{salt}")
    specs = []
    for i in range(num_requests):
        output_len = outputs.sample(lengths, max_model_len - 1 if max_model_len else None)
        prompt_len = prompts.sample(lengths, max_model_len - output_len if max_model_len else None)
        specs.append(RequestSpec(i, tuple(ids.randrange(1, vocab_size) for _ in range(prompt_len)), output_len))
    return specs


def arrival_times(num_requests: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals at `rate` req/s (first at 0); all at 0 when rate is inf."""
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed + 1)  # independent of the prompt stream
    times, t = [], 0.0
    for _ in range(num_requests):
        times.append(t)
        t += rng.expovariate(rate)
    return times


class Progress:
    """A plain progress bar on stderr, redrawn at most every `interval_s`."""

    def __init__(self, total: int, label: str, enabled: bool = True, stream=None, interval_s: float = 0.2):
        self.total, self.label, self.enabled, self.interval_s = total, label, enabled, interval_s
        self.stream = stream or sys.stderr
        self.started, self._drawn = time.perf_counter(), 0.0
        self.dispatched = 0  # requests handed to a task (run_load counts them)

    def update(self, records: Sequence[RequestRecord], force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not force and now - self._drawn < self.interval_s):
            return
        self._drawn = now
        done = sum(r.status in (COMPLETED, FAILED, CANCELLED) for r in records)
        failed = sum(r.status in (FAILED, CANCELLED) for r in records)
        in_flight = self.dispatched - done
        width = 30
        filled = width * done // max(1, self.total)
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} done, "
            f"{in_flight} in flight, {failed} failed, {now - self.started:.1f} s "
        )
        self.stream.flush()

    def close(self, records: Sequence[RequestRecord]) -> None:
        self.update(records, force=True)
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


Sender = Callable[[RequestSpec, RequestRecord, Callable[[], float]], Awaitable[None]]


async def run_load(
    specs: Sequence[RequestSpec],
    arrivals: Sequence[float],
    send: Sender,
    *,
    concurrency: int | None,
    max_seconds: float,
    progress: Progress,
) -> tuple[list[RequestRecord], float]:
    """Send each spec at its arrival time (at most `concurrency` in flight); stop sending at
    max_seconds and cancel what is still running then. Returns the records and the duration
    (run start to the last request's end, or to the deadline)."""
    records = [RequestRecord(s.index, len(s.prompt), s.output_len, at) for s, at in zip(specs, arrivals)]
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    start = time.perf_counter()
    deadline = start + max_seconds

    def clock() -> float:
        return time.perf_counter() - start

    async def one(spec: RequestSpec, record: RequestRecord) -> None:
        try:
            await send(spec, record, clock)
        except asyncio.CancelledError:
            record.status, record.error = CANCELLED, f"cancelled at --max-seconds={max_seconds:g}"
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is counted by its message
            record.status, record.error = FAILED, error_message(exc)
        finally:
            if gate is not None:
                gate.release()
            progress.update(records)

    tasks = []
    for spec, record in zip(specs, records):
        wait = start + record.scheduled_s - time.perf_counter()
        if start + record.scheduled_s >= deadline:
            break
        if wait > 0:
            await asyncio.sleep(wait)
        if gate is not None:
            try:
                await asyncio.wait_for(gate.acquire(), timeout=max(0.0, deadline - time.perf_counter()))
            except TimeoutError:
                break
        tasks.append(asyncio.create_task(one(spec, record)))
        progress.dispatched += 1
        progress.update(records)
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    duration = min(time.perf_counter(), deadline) - start
    progress.close(records)
    return records, duration


def _finish(record: RequestRecord, sent_s: float, events: list[tuple[float, int]]) -> None:
    """TTFT, ITLs and e2e (to the last token-carrying message) from the stream's events."""
    record.ttft_s, record.itl_s = token_gaps(sent_s, events)
    if record.ttft_s is None:
        record.status, record.error = FAILED, "stream ended without a token"
        return
    record.e2e_s = max(t for t, k in events if k > 0) - sent_s
    record.status = COMPLETED


class RequestFailed(RuntimeError):
    """The gateway answered with an error (HTTP status, SSE error event or an ERROR finish)."""


def error_message(exc: BaseException) -> str:
    """A short message for the error counts: gRPC status and details, the gateway's error, or the
    exception's type and text."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):
        return f"gRPC {code().name}: {details()}"
    if isinstance(exc, RequestFailed):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def grpc_sender(stubs: Sequence, temperature: float, timeout_s: float) -> Sender:
    """Streams `Generation.Generate` with token-id prompts, each request on the next of `stubs` (one
    connection each) in turn; counts tokens by the token ids streamed."""
    from splitserve.protos import common_pb2, generation_pb2

    turn = itertools.cycle(stubs)

    async def send(spec: RequestSpec, record: RequestRecord, clock: Callable[[], float]) -> None:
        request = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=spec.prompt),
            sampling=common_pb2.SamplingParams(max_tokens=spec.output_len, ignore_eos=True, temperature=temperature),
        )
        events: list[tuple[float, int]] = []
        record.sent_s = sent = clock()
        async for message in next(turn).Generate(request, timeout=timeout_s):
            events.append((clock(), len(message.token_ids)))
            record.num_received += len(message.token_ids)
            if message.finish_reason:
                record.finish_reason = common_pb2.FinishReason.Name(message.finish_reason)
                record.prompt_tokens_reported = message.usage.prompt_tokens
                record.cached_prompt_tokens = message.usage.cached_prompt_tokens
                if message.finish_reason == common_pb2.FINISH_REASON_ERROR:
                    raise RequestFailed(message.error)
        _finish(record, sent, events)

    return send


def rest_sender(client, base_url: str, model: str, temperature: float) -> Sender:
    """Streams POST /v1/completions (SSE) with a token-id prompt. vLLM's continuous usage stats put the
    running completion_tokens on every chunk, so each chunk counts exactly the tokens it carries (a chunk
    merges several when the client is behind) at no per-token cost beyond the counts."""

    async def send(spec: RequestSpec, record: RequestRecord, clock: Callable[[], float]) -> None:
        body = {
            "model": model,
            "prompt": list(spec.prompt),
            "max_tokens": spec.output_len,
            "ignore_eos": True,
            "temperature": temperature,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        events: list[tuple[float, int]] = []
        record.sent_s = sent = clock()
        response = await _send_post(client, f"{base_url}/v1/completions", body, record.resent_after)
        try:
            if response.status_code != 200:
                raw = await response.aread()
                raise RequestFailed(f"HTTP {response.status_code}: {_error_text(raw)}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now, chunk = clock(), json.loads(line[6:])
                if "error" in chunk:
                    raise RequestFailed(chunk["error"].get("message", str(chunk["error"])))
                usage = chunk.get("usage")
                for choice in chunk.get("choices", []):
                    events.append((now, usage["completion_tokens"] - record.num_received))
                    record.finish_reason = choice.get("finish_reason") or record.finish_reason
                if usage:
                    record.num_received = usage["completion_tokens"]
                    record.prompt_tokens_reported = usage["prompt_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_prompt_tokens = details.get("cached_tokens", 0)
        finally:
            await response.aclose()
        _finish(record, sent, events)

    return send


async def _send_post(client, url: str, body: dict, resent_after: list[str], attempts: int = 3):
    """POST `body` and return the streamed response; sent again when a reused connection ended before the
    answer's head (at most `attempts` sends; the error that ended each send sent again, with the socket error
    behind it, goes to `resent_after`).

    That is HTTP/1.1's keep-alive race: the server closes a connection idle for its keep-alive timeout just as
    the client reuses it. A server that closes cleanly gives a FIN (RemoteProtocolError: it never took the
    request); one that closes a socket holding the request unread gives a reset, which httpx reports as a
    ReadError, or a WriteError on the body (httpx sends a request's head and body apart, so a reset can come
    between them). httpx's pool also closes, on seeing a FIN, an idle connection it has already handed to a
    request that is then sending on it (a ReadError from ClosedResourceError). The request was never
    answered, and a server that had started it cancels it when its connection drops. httpx sends no request
    twice; real clients do here (browsers, and the OpenAI SDK retries every connection error), and without it
    such a request counts as a failure of the server. A connection made for the request that fails is never
    retried: that is a server that failed."""
    import httpx

    for attempt in range(1, attempts + 1):
        made_connection = False

        async def trace(name: str, info: dict) -> None:
            nonlocal made_connection
            made_connection = made_connection or name.startswith("connection.connect_tcp")

        try:
            return await client.send(
                client.build_request("POST", url, json=body, extensions={"trace": trace}), stream=True
            )
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            if made_connection or attempt == attempts:
                raise
            resent_after.append(_with_root_cause(exc))
    raise ValueError(f"attempts must be >= 1, got {attempts}")


def _with_root_cause(exc: BaseException) -> str:
    """The exception's type and, where its chain holds one, the socket's error (a reset: ConnectionResetError,
    or BrokenPipeError after the server's FIN) or else the stream's own (anyio's ClosedResourceError: httpx
    closed the connection itself)."""
    chain, link = [], exc
    while link is not None and len(chain) < 16:
        chain.append(link)
        link = link.__cause__ or link.__context__
    cause = next((e for e in chain if isinstance(e, OSError)), None)
    cause = cause or next((e for e in chain if type(e).__module__.split(".")[0] == "anyio"), None)
    return type(exc).__name__ + (f" ({type(cause).__name__})" if cause is not None else "")


def _error_text(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")[:200]
