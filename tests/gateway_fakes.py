"""Deterministic in-process fakes of the Prefill and Decode services, and a test stack.

The fakes implement the wire contract (protos/) with a token rule that tests can predict:

    first token  = next_token(last prompt token)       (prefill, or a decode prefilling locally)
    each step    = next_token(previous token)          (one token per request per step)
    next_token(t) = t + 1, wrapping from the vocabulary's end to FIRST_WORD

With the word-level tokenizer built here (token i >= FIRST_WORD is the word "w<i>"), the
text of any output is predictable: ids [9, 10, 11] after a prompt read " w9 w10 w11".
Everything runs in one background event loop (`LoopThread`) so tests can use the
synchronous openai / grpc / httpx clients from the test thread.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from splitserve.protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from splitserve.runtime.grpc_server import SERVER_PING_OPTIONS

SPECIAL = ["<s>", "</s>", "<unk>"]
ROLE_WORDS = ["user", "system", "assistant", "hello", "world"]
FIRST_WORD = len(SPECIAL) + len(ROLE_WORDS)  # 8: ids from here are "w<id>"
VOCAB_SIZE = 200
EOS_ID = 1
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)
LAYOUT = common_pb2.KvLayout(
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
    block_size=4,
    dtype="float32",
    model_id="tiny-fake",
    layout="block_major_v1",
)
FR = common_pb2.FinishReason


def word(token_id: int) -> str:
    return (SPECIAL + ROLE_WORDS)[token_id] if token_id < FIRST_WORD else f"w{token_id}"


def make_tokenizer_dir(path: str) -> str:
    """Save a word-level tokenizer (whitespace split, words joined by spaces) with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word(i): i for i in range(VOCAB_SIZE)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


def next_token(token_id: int) -> int:
    return token_id + 1 if token_id + 1 < VOCAB_SIZE else FIRST_WORD


def expected_ids(prompt_ids: list[int], n: int) -> list[int]:
    """The n tokens every fake generates after `prompt_ids`."""
    out, last = [], prompt_ids[-1]
    for _ in range(n):
        last = next_token(last)
        out.append(last)
    return out


def fake_logprobs(token_id: int, top: int) -> common_pb2.TokenLogprobs:
    """Logprob -token_id/100 for the chosen token; alternatives token_id+1.. at lower logprobs."""
    return common_pb2.TokenLogprobs(
        token_id=token_id,
        logprob=-token_id / 100,
        top=[common_pb2.TopLogprob(token_id=token_id + k, logprob=-(token_id + k) / 100 - k) for k in range(top)],
    )


def fake_describe(
    name: str, role: str, layout: common_pb2.KvLayout, max_model_len: int, load: common_pb2.Load, start_ns: int
) -> common_pb2.DescribeResponse:
    """What a fake instance answers to Describe (shm only)."""
    return common_pb2.DescribeResponse(
        instance_id=name,
        role=role,
        model_id=layout.model_id,
        layout=layout,
        load=load,
        transports=["shm"],
        start_unix_ns=start_ns,
        max_model_len=max_model_len,
    )


class FakePrefill(prefill_pb2_grpc.PrefillServicer):
    """Answers the first token and a KV handle (one block id per started block of the prompt)."""

    def __init__(
        self,
        name: str = "prefill-0",
        *,
        layout: common_pb2.KvLayout = LAYOUT,
        max_model_len: int = 64,
        cached_prompt_tokens: int = 0,
    ) -> None:
        self.name, self.layout, self.max_model_len = name, layout, max_model_len
        self.cached_prompt_tokens = cached_prompt_tokens
        self.requests: list[prefill_pb2.PrefillRequest] = []
        self.released: list[tuple[str, int]] = []
        self.fail_code: grpc.StatusCode | None = None  # set to make Prefill fail
        self.delay_s = 0.0
        self.gate: asyncio.Event | None = None  # when set: Prefill answers only once the test sets it (on the loop)
        self.queued_tokens = 0  # reported as Describe's load.num_queued_tokens
        self.start_ns = time.time_ns()
        self.address = ""
        self.health_address = ""  # advertised in Describe (the services' Describe-only server)
        self.describes = 0
        self.cancelled = 0  # Prefill calls the gateway cancelled while they waited here

    async def Prefill(self, request, context):
        self.requests.append(request)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.gate is not None:
                await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.fail_code is not None:
            await context.abort(self.fail_code, "injected prefill failure")
        first = next_token(request.prompt_token_ids[-1])
        sampling = request.sampling
        response = prefill_pb2.PrefillResponse(
            request_id=request.request_id,
            first_token_id=first,
            cached_prompt_tokens=self.cached_prompt_tokens,
            timings=common_pb2.Timings(queue_ns=1000, prefill_ns=2000),
        )
        if sampling.HasField("logprobs"):
            response.first_logprobs.CopyFrom(fake_logprobs(first, sampling.logprobs))
        if sampling.HasField("max_tokens") and sampling.max_tokens == 1:
            response.finish_reason = FR.FINISH_REASON_LENGTH  # no KV held then
            return response
        n = len(request.prompt_token_ids)
        bs = self.layout.block_size
        response.kv.CopyFrom(
            common_pb2.KvHandle(
                prefill_instance=self.name,
                prefill_address=self.address,
                block_ids=list(range((n + bs - 1) // bs)),
                num_tokens=n,
                lease=common_pb2.Lease(lease_id=f"lease-{request.request_id}", epoch=7),
                transport="shm",
                layout=self.layout,
            )
        )
        return response

    async def ReleaseKv(self, request, context):
        self.released.append((request.lease_id, request.epoch))
        return prefill_pb2.ReleaseKvResponse(released=True)

    async def Describe(self, request, context):
        self.describes += 1
        load = common_pb2.Load(num_free_blocks=1000, num_total_blocks=1000, num_queued_tokens=self.queued_tokens)
        response = fake_describe(self.name, "prefill", self.layout, self.max_model_len, load, self.start_ns)
        response.health_address = self.health_address
        return response


@dataclass
class _Running:
    request: decode_pb2.DecodeRequest
    last: int
    generated: int
    limit: int
    first_delta: bool = True


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    """One step every step_s: one token for every running request of a stream, in one DecodeOut."""

    def __init__(
        self,
        name: str = "decode-0",
        *,
        role: str = "decode",
        layout: common_pb2.KvLayout = LAYOUT,
        max_model_len: int = 64,
        step_s: float = 0.01,
        free_blocks: int = 1000,
        cached_prompt_tokens: int = 0,
    ) -> None:
        self.name, self.role, self.layout, self.max_model_len = name, role, layout, max_model_len
        self.step_s, self.free_blocks = step_s, free_blocks
        self.cached_prompt_tokens = cached_prompt_tokens
        self.requests: list[decode_pb2.DecodeRequest] = []
        self.aborts: list[str] = []
        self.num_streams = 0
        self.max_deltas_per_message = 0
        self.num_outputs = 0  # DecodeOut messages written, over every stream
        self.num_outputs_read = 0  # the latest OutputsRead the gateway sent
        self.running: dict[str, _Running] = {}
        self.hold = False  # True = produce nothing (requests stay running)
        self.unavailable = ""  # set: answer each new request as a draining or starting decode does, with this error
        self.waiting = 0  # num_waiting reported by Describe
        self.reserves: list[decode_pb2.SeatRequest] = []  # seat reservations received
        self.grant_seats = True  # False = keep reservations waiting (`seats_waiting`) until set True again
        self.seats_waiting: list[str] = []  # reservations not granted (of every stream)
        self.describe_delay_s = 0.0  # Describe answers this late
        self.describes = 0
        self.start_ns = time.time_ns()

    async def Describe(self, request, context):
        self.describes += 1
        if self.describe_delay_s:
            await asyncio.sleep(self.describe_delay_s)  # a busy instance answering late
        load = common_pb2.Load(
            num_free_blocks=self.free_blocks,
            num_total_blocks=self.free_blocks,
            num_running=len(self.running),
            num_waiting=self.waiting,
        )
        return fake_describe(self.name, self.role, self.layout, self.max_model_len, load, self.start_ns)

    async def Generate(self, request_iterator, context):
        self.num_streams += 1
        mine: dict[str, _Running] = {}
        outbox: list[decode_pb2.TokenDelta] = []
        seats: list[str] = []  # this stream's reservations, granted when grant_seats is True
        reader = asyncio.ensure_future(self._read(request_iterator, mine, outbox, seats))
        try:
            while not (reader.done() and not mine and not outbox):
                await asyncio.sleep(self.step_s)
                granted = [rid for rid in seats if self.grant_seats]
                for rid in granted:
                    seats.remove(rid)
                    self.seats_waiting.remove(rid)
                if self.hold and not granted:
                    continue
                steps = [] if self.hold else [self._step(rid, run, mine) for rid, run in list(mine.items())]
                deltas = outbox[:] + steps
                outbox.clear()
                if deltas or granted:
                    self.max_deltas_per_message = max(self.max_deltas_per_message, len(deltas))
                    yield decode_pb2.DecodeOut(deltas=deltas, step_ns=1000, seats_granted=granted)
                    self.num_outputs += 1
        finally:
            reader.cancel()
            for rid in mine:
                self.running.pop(rid, None)
            for rid in seats:
                self.seats_waiting.remove(rid)

    async def _read(self, request_iterator, mine: dict, outbox: list, seats: list) -> None:
        async for message in request_iterator:
            if message.WhichOneof("kind") == "outputs_read":  # pacing: this fake writes without waiting
                self.num_outputs_read = message.outputs_read.num_outputs
            elif message.WhichOneof("kind") == "reserve":
                self.reserves.append(message.reserve)
                seats.append(message.reserve.request_id)
                self.seats_waiting.append(message.reserve.request_id)
            elif message.WhichOneof("kind") == "request":
                req = message.request
                self.requests.append(req)
                if self.unavailable:
                    delta = decode_pb2.TokenDelta(request_id=req.request_id, finish_reason=FR.FINISH_REASON_ERROR)
                    delta.error, delta.unavailable = self.unavailable, True
                    outbox.append(delta)
                    continue
                local = not req.HasField("first_token_id")
                limit = (
                    req.sampling.max_tokens
                    if req.sampling.HasField("max_tokens")
                    else self.max_model_len - len(req.prompt_token_ids)
                )
                run = _Running(req, req.prompt_token_ids[-1] if local else req.first_token_id, 0 if local else 1, limit)
                mine[req.request_id] = self.running[req.request_id] = run
                for fork_id in req.fork_ids:  # the other sequences (n > 1): from the prompt, as a local prefill
                    fork = _Running(req, req.prompt_token_ids[-1], 0, limit)
                    mine[fork_id] = self.running[fork_id] = fork
            else:
                rid = message.abort.request_id
                self.aborts.append(rid)
                if rid in seats:
                    seats.remove(rid)
                    self.seats_waiting.remove(rid)
                if mine.pop(rid, None) is not None:
                    self.running.pop(rid, None)
                    outbox.append(decode_pb2.TokenDelta(request_id=rid, finish_reason=FR.FINISH_REASON_ABORT))

    def _step(self, rid: str, run: _Running, mine: dict) -> decode_pb2.TokenDelta:
        token = next_token(run.last)
        run.last, run.generated = token, run.generated + 1
        delta = decode_pb2.TokenDelta(request_id=rid, token_ids=[token])
        sampling = run.request.sampling
        if sampling.HasField("logprobs"):
            delta.logprobs.append(fake_logprobs(token, sampling.logprobs))
        if run.first_delta:
            delta.cached_prompt_tokens = self.cached_prompt_tokens
            run.first_delta = False
        if token in sampling.stop_token_ids:
            delta.finish_reason = FR.FINISH_REASON_STOP
        elif run.generated >= run.limit:
            delta.finish_reason = FR.FINISH_REASON_LENGTH
        if delta.finish_reason:
            delta.timings.CopyFrom(common_pb2.Timings(queue_ns=10, transfer_ns=300, decode_ns=5000))
            del mine[rid]
            self.running.pop(rid, None)
        return delta


class LoopThread:
    """An asyncio loop in a daemon thread; run(coro) executes there and returns the result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout_s: float = 15.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    @property
    def native_id(self) -> int:
        """The loop thread's kernel thread id (for /proc/self/task/<id>)."""
        return self._thread.native_id

    def call(self, fn: Callable[[], Any]) -> Any:
        async def wrapper():
            return fn()

        return self.run(wrapper())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


@dataclass
class FakeServer:
    """A fake servicer served on a loopback port (restartable on the same port)."""

    servicer: Any
    port: int = 0
    server: Any = None
    credentials: Any = None  # grpc.ServerCredentials: serve TLS

    async def start(self) -> None:
        self.server = grpc.aio.server(options=SERVER_PING_OPTIONS)  # as a service's: the gateway pings it
        if isinstance(self.servicer, FakePrefill):
            prefill_pb2_grpc.add_PrefillServicer_to_server(self.servicer, self.server)
        else:
            decode_pb2_grpc.add_DecodeServicer_to_server(self.servicer, self.server)
        address = f"127.0.0.1:{self.port}"
        if self.credentials is not None:
            self.port = self.server.add_secure_port(address, self.credentials)
        else:
            self.port = self.server.add_insecure_port(address)
        self.servicer.address = self.address
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(0)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class Stack:
    """Fake prefills and decodes plus a real GatewayServer, all in one LoopThread."""

    tokenizer_dir: str
    prefills: list = field(default_factory=list)
    decodes: list = field(default_factory=list)
    overrides: dict = field(default_factory=dict)
    rest: bool = True  # serve the REST shim (on a pre-bound loopback socket)
    env: dict = field(default_factory=dict)  # the gateway's environment (SPLITSERVE_API_KEYS)
    resolver: Any = None  # answers the gateway's dns:/// names (FakeResolver)
    credentials: dict = field(default_factory=dict)  # fake's name -> grpc.ServerCredentials: it serves TLS
    counts: Any = None  # the gateway's admission counts (gateway/admission.py); None: its own

    def start(self) -> Stack:
        from splitserve.gateway.config import GatewayConfig
        from splitserve.gateway.server import GatewayServer

        self.loop = LoopThread()
        self.servers = {
            s.name: FakeServer(s, credentials=self.credentials.get(s.name)) for s in self.prefills + self.decodes
        }
        for server in self.servers.values():
            self.loop.run(server.start())
        http = None
        if self.rest:
            http = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            http.bind(("127.0.0.1", 0))
        values = dict(
            grpc_port=0,
            model=self.tokenizer_dir,
            health_interval_s=0.1,
            drain_grace_s=1.0,
            prefill=",".join(self.servers[p.name].address for p in self.prefills),
            decode=",".join(self.servers[d.name].address for d in self.decodes),
        )
        values.update(self.overrides)
        values.setdefault("http_port", 0)
        self.gateway = GatewayServer(
            GatewayConfig(**values), http_socket=http, env=self.env, resolver=self.resolver, counts=self.counts
        )
        self.loop.run(self.gateway.start())
        self.grpc_target = f"127.0.0.1:{self.gateway.grpc_port}"
        scheme = "https" if values.get("tls_cert") else "http"
        self.base_url = f"{scheme}://127.0.0.1:{self.gateway.http_port}"
        return self

    def internal_id(self, request_id: str) -> str:
        """The id the gateway gives a caller's request on the internal hops (prefill, decode, lease)."""
        return f"{request_id}@{self.gateway.service.instance_tag}"

    def stop(self) -> None:
        self.loop.run(self.gateway.stop(0.5))
        for server in self.servers.values():
            self.loop.run(server.stop())
        self.loop.close()

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> None:
        """Poll `predicate` on the loop thread until true."""
        # imported here: this file is also run as a script and loaded by path (benchmarks/gateway_cost.py),
        # where `tests` is no package on sys.path
        from tests.service_harness import wait_until

        wait_until(lambda: self.loop.call(predicate), timeout_s, f"waiting for {what}")


class FakeResolver:
    """A DNS the test controls: `answers` maps a host to its members (fake servicers, answered with the
    address they are served at, or "ip:port" strings) or to an OSError to raise; an unknown host fails as
    getaddrinfo does. `lookups` counts the lookups of each host (called from the gateway's worker threads)."""

    def __init__(self, answers: dict | None = None) -> None:
        self.answers: dict[str, Any] = dict(answers or {})
        self.lookups: collections.Counter = collections.Counter()

    def resolve(self, host: str, port: int) -> list[str]:
        self.lookups[host] += 1
        answer = self.answers.get(host, socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
        if isinstance(answer, Exception):
            raise answer
        return [m if isinstance(m, str) else m.address for m in answer]


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(sample name, sorted (label, value) pairs without model/instance): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ("model_name", "instance")))
            out[(sample.name, labels)] = sample.value
    return out


class _EchoPrefill(FakePrefill):
    """A FakePrefill that prints one line per Prefill call (run as a script: `up` echoes its children's lines)."""

    async def Prefill(self, request, context):
        print(f"Prefill {request.request_id}", flush=True)
        return await super().Prefill(request, context)


async def _serve_forever(kind: str, port: int, name: str) -> None:
    import signal

    servicer = _EchoPrefill(name) if kind == "prefill" else FakeDecode(name)
    server = FakeServer(servicer, port)
    await server.start()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop()


if __name__ == "__main__":  # python tests/gateway_fakes.py prefill|decode PORT NAME (for `up` tests)
    import sys

    asyncio.run(_serve_forever(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
