"""A keep-alive REST connection reused just as the gateway's idle timeout closes it loses no request.

`splitserve gateway --api-server-count 2 --http-keep-alive-s 0.2` in front of a fake prefill and decode
(tests/gateway_fakes.py run as processes). Each probe is a client that, like httpx's pool, reuses its connection
unless it has seen the server's FIN, after an idle gap drawn around the keep-alive timeout: some requests come
before the timeout, some after the server has closed, and some in between.

What the kernel says tells the two closes apart. A server that sends its FIN before the request arrives closed
cleanly: the client sees the close before sending, or reads the end of the stream with no byte of an answer, and
sends the request again on a new connection, as HTTP/1.1 lets a client do with a request the server never took. A
server that closes a socket holding a request it has not read makes the kernel answer with a reset instead of a
FIN: the request reached the server and was lost (the `httpx.ReadError` a load generator sees). No reset may
happen, and every request is answered with its exact text.
"""

import json
import random
import select
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.gateway_fakes import make_tokenizer_dir
from tests.service_harness import Proc, free_port, gateway_args, wait_until

pytestmark = pytest.mark.slow
FAKES_PY = str(Path(__file__).parent.parent / "gateway_fakes.py")
KEEP_ALIVE_S = 0.2
AROUND_S = (-0.002, 0.004)  # each idle gap: the keep-alive timeout plus a draw from here
PROBES, PROBE_S = 8, 4.0  # connections probing at once, and for how long
BODY = json.dumps({"model": "tiny-fake", "prompt": "hello world w20", "max_tokens": 3}).encode()
TEXT = " w21 w22 w23"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """The gateway's REST port, in front of a fake prefill and decode run as processes of their own (this process
    only probes, so its timing is its own)."""
    logs = tmp_path_factory.mktemp("logs")
    ports = {kind: free_port() for kind in ("prefill", "decode")}
    fakes = [
        subprocess.Popen([sys.executable, FAKES_PY, kind, str(port), f"{kind}-0"], stdout=subprocess.DEVNULL)
        for kind, port in ports.items()
    ]
    tokenizer = make_tokenizer_dir(str(tmp_path_factory.mktemp("tokenizer")))
    grpc_port, http_port = free_port(), free_port()
    args = gateway_args(grpc_port, http_port, f"127.0.0.1:{ports['prefill']}", f"127.0.0.1:{ports['decode']}")
    args += ["--model", tokenizer, "--api-server-count", "2", "--http-keep-alive-s", str(KEEP_ALIVE_S)]
    proc = Proc("gateway", [*args, "--health-interval-s", "0.1"], logs, "gateway")
    log = Path(proc.log_path)
    try:
        wait_until(lambda: log.read_text().count("gateway up:") == 2, 60, lambda: f"both up; log:\n{log.read_text()}")
        yield http_port
    finally:
        proc.stop()
        for fake in fakes:
            fake.kill()
            fake.wait()


class Probe:
    """One client reusing one connection after idle gaps around the keep-alive; counts what each request met."""

    def __init__(self, port: int, seed: int) -> None:
        self.port, self.seed, self.outcomes, self.wrong = port, seed, Counter(), []
        self.request = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(BODY)}\r\n\r\n"
        ).encode() + BODY
        self.sock = None

    def connect(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def exchange(self) -> str:
        """Send the request and read its answer: "answered", "closed" (the server's FIN, no byte of an answer)
        or "reset" (the server dropped the request it had received)."""
        try:
            self.sock.sendall(self.request)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = self.sock.recv(65536)
                if not chunk:
                    assert not head, f"the connection closed in the middle of an answer: {head!r}"
                    return "closed"
                head += chunk
        except ConnectionResetError:
            return "reset"
        head, body = head.split(b"\r\n\r\n", 1)
        lines = head.lower().split(b"\r\n")
        length = int(next(line.split(b":")[1] for line in lines if line.startswith(b"content-length:")))
        while len(body) < length:
            body += self.sock.recv(65536)
        if not head.startswith(b"HTTP/1.1 200") or json.loads(body)["choices"][0]["text"] != TEXT:
            self.wrong.append(head + body)
        return "answered"

    def run(self, until: float) -> None:
        gaps = random.Random(self.seed)
        self.connect()
        self.outcomes["answered on a new connection"] += self.exchange() == "answered"
        while time.monotonic() < until:
            time.sleep(KEEP_ALIVE_S + gaps.uniform(*AROUND_S))
            if select.select([self.sock], [], [], 0)[0]:  # the FIN came first: what httpx's pool checks
                outcome = "seen closed"
            else:
                outcome = self.exchange()
            self.outcomes[outcome] += 1
            if outcome != "answered":  # the request goes again, on a new connection
                self.connect()
                self.outcomes["answered on a new connection"] += self.exchange() == "answered"


def test_a_connection_reused_as_the_idle_timeout_closes_it_loses_no_request(gateway):
    probes = [Probe(gateway, seed) for seed in range(PROBES)]
    until = time.monotonic() + PROBE_S
    threads = [threading.Thread(target=p.run, args=(until,)) for p in probes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PROBE_S + 30)
    outcomes = sum((p.outcomes for p in probes), Counter())
    assert not any(p.wrong for p in probes), [p.wrong[0] for p in probes if p.wrong]
    # the gaps straddled the timeout: requests answered on reused connections, and closes seen before sending
    assert outcomes["answered"] >= 10 and outcomes["seen closed"] >= 10, outcomes
    assert outcomes["reset"] == 0, outcomes
    retried = outcomes["seen closed"] + outcomes["closed"]
    assert outcomes["answered on a new connection"] == PROBES + retried, outcomes
