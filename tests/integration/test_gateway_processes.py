"""`splitserve gateway --api-server-count 2` as real processes in front of fake prefill / decode services (served
from this test's loop, tests/gateway_fakes.py): both processes take REST and gRPC connections, answer what one
process answers, and count once for the whole gateway (admission, rate limits, /metrics); SIGTERM drains and stops
them all; a process that dies stops the gateway; a taken port is one clear error.

Which process served what is read from outside: the gateway processes are the supervisor's spawned children
(/proc), and each writes its own metrics file (counter_<pid>.db) in the folder its environment names.
"""

import asyncio
import os
import re
import signal
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.multiprocess import MultiProcessCollector

from splitserve.protos import common_pb2, generation_pb2, generation_pb2_grpc
from tests.gateway_fakes import FakeDecode, FakePrefill, FakeServer, LoopThread, expected_ids, make_tokenizer_dir
from tests.gateway_fakes import parse_metrics as parse
from tests.service_harness import Proc, free_port, gateway_args, wait_until

pytestmark = pytest.mark.slow
PROMPT, PROMPT_IDS = "hello world w20", [6, 7, 20]
KEYS = {"traffic": "k-traffic", "admission": "k-admission", "tokens": "k-tokens"}
REQUESTS = "splitserve:gateway_requests_total"


@pytest.fixture(scope="module")
def fakes(tmp_path_factory):
    loop = LoopThread()
    prefill = FakePrefill(max_model_len=8192)
    decode = FakeDecode(max_model_len=8192, step_s=0.002, free_blocks=1 << 20)
    servers = [FakeServer(prefill), FakeServer(decode)]
    for server in servers:
        loop.run(server.start())
    tokenizer = make_tokenizer_dir(str(tmp_path_factory.mktemp("tokenizer")))
    yield loop, prefill, servers, tokenizer
    for server in servers:
        loop.run(server.stop())
    loop.close()


class Gateway:
    """A `splitserve gateway --api-server-count 2` process (the supervisor) and its ports."""

    def __init__(self, fakes, logs: Path, *more: str, wait: bool = True) -> None:
        _, _, servers, tokenizer = fakes
        self.grpc_port, self.http_port = free_port(), free_port()
        args = gateway_args(self.grpc_port, self.http_port, servers[0].address, servers[1].address)
        args += ["--model", tokenizer, "--api-server-count", "2", "--health-interval-s", "0.1", "--drain-grace-s", "10"]
        self.proc = Proc("gateway", [*args, *more], logs, f"gateway-{len(list(logs.iterdir()))}")
        self.base = f"http://127.0.0.1:{self.http_port}"
        if wait:
            wait_until(self._up, 60, lambda: f"both gateway processes up; log:\n{self.log()[-3000:]}", poll_s=0.1)

    def log(self) -> str:
        return self.proc.log_path.read_text()

    def _up(self) -> bool:
        assert self.proc.popen.poll() is None, f"the gateway exited {self.proc.popen.returncode}:\n{self.log()}"
        log = self.log()
        return log.count("gateway up:") == 2 and log.count(" is up (role ") == 4  # 2 instances x 2 processes

    def pids(self) -> list[int]:
        """The gateway processes (the supervisor's spawned children; not multiprocessing's resource tracker)."""
        pid = self.proc.popen.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return sorted(int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes())

    def metrics_folder(self) -> str:
        environ = Path(f"/proc/{self.pids()[0]}/environ").read_bytes().split(b"\0")
        return next(v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"PROMETHEUS_MULTIPROC_DIR="))

    def calls_by_process(self) -> dict[int, dict[tuple[str, str], float]]:
        """Each gateway process's requests_total by (route, status), read from its own metrics file."""
        out = {}
        for pid in self.pids():
            families = MultiProcessCollector.merge([f"{self.metrics_folder()}/counter_{pid}.db"])
            samples = [s for f in families for s in f.samples if s.name == REQUESTS]
            out[pid] = {(s.labels["route"], s.labels["status"]): s.value for s in samples}
        return out

    def metrics(self) -> dict:
        return parse(httpx.get(f"{self.base}/metrics", timeout=10).text)

    def complete(self, key: str, prompt: str = PROMPT, max_tokens: int = 3) -> httpx.Response:
        """One completion on a connection of its own (the kernel picks the process per connection)."""
        body = {"model": "tiny-fake", "prompt": prompt, "max_tokens": max_tokens}
        return httpx.post(f"{self.base}/v1/completions", json=body, headers=bearer(key), timeout=30)

    def generate(self, key: str, max_tokens: int = 3) -> list[int]:
        """One gRPC Generate on a connection of its own; its token ids."""
        with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}", [("grpc.use_local_subchannel_pool", 1)]) as ch:
            request = generation_pb2.GenerateRequest(
                text=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=max_tokens)
            )
            stub = generation_pb2_grpc.GenerationStub(ch)
            messages = stub.Generate(request, timeout=30, metadata=(("authorization", f"Bearer {key}"),))
            return [t for m in messages for t in m.token_ids]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def keys_file(folder: Path, *keys: str) -> str:
    path = folder / "keys"
    path.write_text("\n".join(keys) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def gateway(fakes, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    keys = keys_file(tmp_path_factory.mktemp("keys"), *KEYS.values())
    limits = ["--max-concurrent-requests", "3", "--rate-limit-tokens-per-min", "600"]  # per key: each test has one
    g = Gateway(fakes, logs, *limits, "--api-keys-file", keys)
    yield g
    g.proc.stop()


def route_totals(gateway: Gateway, route: str, status: str) -> list[float]:
    return [calls.get((route, status), 0.0) for calls in gateway.calls_by_process().values()]


def test_rest_and_grpc_requests_land_on_both_processes_and_add_up_exactly(gateway):
    pids = gateway.pids()
    assert len(pids) == 2 and gateway.proc.popen.pid not in pids
    num = 16  # each on a new connection: all on one process has probability 2**-15
    for _ in range(num):
        r = gateway.complete(KEYS["traffic"])
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == " w21 w22 w23" and r.json()["usage"]["completion_tokens"] == 3
        assert gateway.generate(KEYS["traffic"]) == expected_ids(PROMPT_IDS, 3)
    rest = route_totals(gateway, "/v1/completions", "200")
    grpc_calls = route_totals(gateway, "/splitserve.v1.Generation/Generate", "OK")
    assert min(rest) > 0 and min(grpc_calls) > 0, (rest, grpc_calls)  # both processes served both APIs
    assert sum(rest) == num and sum(grpc_calls) == num
    totals = gateway.metrics()  # whichever process answers: every process's counts, once
    assert totals[(REQUESTS, (("route", "/v1/completions"), ("status", "200")))] == num
    assert totals[(REQUESTS, (("route", "/splitserve.v1.Generation/Generate"), ("status", "OK")))] == num
    assert totals[("splitserve:gateway_generation_tokens_total", ())] == 2 * num * 3
    assert totals[("splitserve:gateway_request_success_total", (("finished_reason", "length"),))] == 2 * num
    assert totals[("splitserve:gateway_e2e_request_latency_seconds_count", ())] == 2 * num
    for pool in ("prefill", "decode"):  # what both processes see of one pool, once (not added up)
        assert totals[("splitserve:gateway_pool_members", (("pool", pool), ("state", "up")))] == 1


def test_max_concurrent_requests_holds_for_the_whole_gateway(gateway, fakes):
    """3 requests held at the prefill fill --max-concurrent-requests 3 of the gateway: every later one is refused,
    on both processes, though at least one of them runs fewer than 3 itself."""
    loop, prefill, _, _ = fakes
    prefill.gate = asyncio.Event()
    before = route_totals(gateway, "/v1/completions", "503")
    with ThreadPoolExecutor(3) as pool:
        pending = [pool.submit(gateway.complete, KEYS["admission"]) for _ in range(3)]
        wait_until(lambda: gateway.metrics()[("splitserve:gateway_num_requests_running", ())] == 3, 20, "3 in flight")
        refused = [gateway.complete(KEYS["admission"]) for _ in range(16)]
        loop.call(prefill.gate.set)
        answers = [f.result(30) for f in pending]
    prefill.gate = None
    assert [r.status_code for r in refused] == [503] * 16
    message = refused[0].json()["error"]["message"]
    assert message == "the gateway already runs 3 requests (max_concurrent_requests=3); retry later"
    after = route_totals(gateway, "/v1/completions", "503")
    assert min(a - b for a, b in zip(after, before, strict=True)) > 0, (before, after)  # both refused some
    assert [r.json()["choices"][0]["text"] for r in answers] == [" w21 w22 w23"] * 3
    wait_until(lambda: gateway.metrics()[("splitserve:gateway_num_requests_running", ())] == 0, 20, "none in flight")


def test_a_rate_limit_holds_for_the_whole_gateway(gateway):
    """600 tokens a minute per key, 100 a request (97 prompt + 3): exactly 6 of 16 requests pass across both
    processes (each process alone would have let 6 of its own through)."""
    before = [sum(calls.values()) for calls in gateway.calls_by_process().values()]
    answers = [gateway.complete(KEYS["tokens"], prompt=" ".join(["w20"] * 97)).status_code for _ in range(16)]
    assert sorted(answers) == [200] * 6 + [429] * 10, answers
    after = [sum(calls.values()) for calls in gateway.calls_by_process().values()]
    assert min(a - b for a, b in zip(after, before, strict=True)) > 0, (before, after)  # both took requests


def test_a_process_that_dies_is_reported_and_stops_the_gateway(gateway):
    """(Last of the tests on the module's gateway: it ends it.)"""
    victim, other = gateway.pids()
    os.kill(victim, signal.SIGKILL)
    assert gateway.proc.popen.wait(30) == 1
    assert re.search(rf"gateway process [01] \(pid {victim}\) exited with code -9; stopping the other 1", gateway.log())
    wait_until(lambda: not Path(f"/proc/{other}").exists(), 10, f"process {other} gone")


def test_sigterm_drains_every_process_then_stops_them_all(fakes, tmp_path):
    """SIGTERM to the supervisor reaches both processes: the idle one exits at once, the other refuses new
    requests (503 naming the drain) and finishes the one in flight; then the supervisor exits 0, its folder
    removed."""
    loop, prefill, _, _ = fakes
    g = Gateway(fakes, tmp_path)
    pids, folder = g.pids(), g.metrics_folder()
    prefill.gate = asyncio.Event()
    try:
        check_drain(g, loop, prefill, pids, folder)
    finally:
        prefill.gate = None
        g.proc.stop()  # no process outlives a failed check


def check_drain(g: Gateway, loop, prefill, pids: list[int], folder: str) -> None:
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(g.complete, "")
        wait_until(lambda: g.metrics()[("splitserve:gateway_num_requests_running", ())] == 1, 20, "1 in flight")
        os.kill(g.proc.popen.pid, signal.SIGTERM)
        wait_until(lambda: g.log().count("SIGTERM: draining") == 2, 20, lambda: f"both draining:\n{g.log()}")
        # the idle process is gone (a connection left in its listener's queue as it closes would be reset)
        wait_until(lambda: sum(Path(f"/proc/{p}").exists() for p in pids) == 1, 20, "the idle process gone")
        refused = [g.complete("") for _ in range(6)]
        loop.call(prefill.gate.set)
        answer = pending.result(30)
    assert {r.status_code for r in refused} == {503}
    assert refused[0].json()["error"]["message"] == "the gateway is shutting down; retry on another gateway"
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == " w21 w22 w23"
    assert g.proc.popen.wait(30) == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    assert not os.path.exists(folder)


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port"])
def test_a_taken_port_is_one_clear_error(fakes, tmp_path, flag):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        g = Gateway(fakes, tmp_path, flag, str(port), wait=False)
        try:
            assert g.proc.popen.wait(30) == 1
        finally:
            g.proc.stop()
    assert f"error: {flag} {port} cannot be bound on 127.0.0.1: Address already in use" in g.log()
    assert "gateway up" not in g.log() and "processes on gRPC" not in g.log()
