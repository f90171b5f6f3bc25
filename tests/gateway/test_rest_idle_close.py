"""The REST server's close of an idle keep-alive connection, driven step by step in one event loop.

HTTP/1.1's keep-alive race: the server closes a connection idle for its timeout while the client, which has not
seen the FIN yet, sends its next request on it. httpx writes a request's head and its body in two sends, with an
event-loop turn between them. The server must never answer such a request with a reset (the client reads
ECONNRESET: an `httpx.ReadError` on the body's send or the answer's read, which does not say whether the server
took the request); the client must read a clean end of stream with no byte of an answer, which clients read as
"never taken" and may send again. The server here is the gateway's own uvicorn setup (`embedded_uvicorn`) with a
trivial app, and the test fires the idle timeout itself at the moment the race needs.
"""

import array
import asyncio
import fcntl
import socket
import termios

from uvicorn.server import ServerState

from splitserve.gateway import rest_server
from splitserve.gateway.config import GatewayConfig
from tests.service_harness import wait_until_async


async def echo_app(scope, receive, send) -> None:
    """Answers every request with "echo:" and its body."""
    body, more = b"", True
    while more:
        message = await receive()
        body, more = body + message.get("body", b""), message.get("more_body", False)
    answer = b"echo:" + body
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(answer))]})
    await send({"type": "http.response.body", "body": answer})


def request_parts(body: bytes) -> tuple[bytes, bytes]:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Length: %d\r\n\r\n" % len(body)
    return head, body


class Server:
    """The gateway's uvicorn protocol on a loopback port; keeps each connection's protocol for the test."""

    def __init__(self) -> None:
        # the idle timeout fires only when the test calls it
        config = rest_server.embedded_uvicorn(echo_app, GatewayConfig(http_keep_alive_s=3600.0), 1.0).config
        config.load()
        self.state, self.protocols, self._config = ServerState(), [], config

    def _protocol(self):
        protocol = self._config.http_protocol_class(config=self._config, server_state=self.state, app_state={})
        self.protocols.append(protocol)
        return protocol

    async def __aenter__(self) -> "Server":
        self._server = await asyncio.get_running_loop().create_server(self._protocol, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        for protocol in list(self.state.connections):
            protocol.transport.abort()
        self._server.close()
        await self._server.wait_closed()


def holds(predicate):
    """`predicate` as the coroutine function that wait_until_async polls."""

    async def check() -> bool:
        return predicate()

    return check


def unread_bytes(transport) -> int:
    """Bytes waiting in the server's socket (0 once it is closed)."""
    sock = transport.get_extra_info("socket")
    if sock.fileno() < 0:
        return 0
    count = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, count)
    return count[0]


async def connect(port: int) -> socket.socket:
    client = socket.socket()
    client.setblocking(False)
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", port))
    return client


async def read_answer(client: socket.socket) -> bytes:
    """One answer's status line and body."""
    loop, data = asyncio.get_running_loop(), b""
    while b"\r\n\r\n" not in data:
        chunk = await asyncio.wait_for(loop.sock_recv(client, 65536), 10)
        assert chunk, f"the connection closed in the middle of an answer: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(
        next(line.split(b":")[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length"))
    )
    while len(body) < length:
        body += await asyncio.wait_for(loop.sock_recv(client, 65536), 10)
    return head.split(b"\r\n")[0] + b" " + body


async def send_after_idle_close() -> tuple[str, int]:
    """One answered request, the idle timeout, then a request whose head goes out before the client has seen the
    FIN and whose body goes out after the server has acted on it. Returns what the client met on that request
    and the connections the server still holds once the client closed its end."""
    loop = asyncio.get_running_loop()
    async with Server() as server:
        client = await connect(server.port)
        await loop.sock_sendall(client, b"".join(request_parts(b"one")))
        assert await read_answer(client) == b"HTTP/1.1 200 OK echo:one"
        protocol = server.protocols[0]
        head, body = request_parts(b"two")
        protocol.timeout_keep_alive_handler()  # nothing has arrived: the idle connection is closed
        client.send(head)  # in the same loop turn: the server's close has not gone further yet
        # the server has read the head, or closed the socket holding it
        handled = holds(lambda: unread_bytes(protocol.transport) == 0)
        await wait_until_async(handled, 10, "the server neither read the request head nor closed")
        try:
            await loop.sock_sendall(client, body)
            answer = await asyncio.wait_for(loop.sock_recv(client, 65536), 10)
            outcome = "clean end of stream" if answer == b"" else f"answered {answer!r}"
        except (ConnectionResetError, BrokenPipeError) as exc:
            outcome = f"reset ({type(exc).__name__})"
        client.close()
        await wait_until_async(
            holds(lambda: not server.state.connections), 10, "the server kept the connection after the client closed"
        )
        return outcome, len(server.state.connections)


def test_a_request_sent_as_the_idle_close_goes_out_meets_a_clean_close_never_a_reset():
    assert asyncio.run(send_after_idle_close()) == ("clean end of stream", 0)


async def send_before_idle_close() -> bytes:
    """A whole request that reached the server's socket before the idle timeout fired, unread yet."""
    loop = asyncio.get_running_loop()
    async with Server() as server:
        client = await connect(server.port)
        await loop.sock_sendall(client, b"".join(request_parts(b"one")))
        assert await read_answer(client) == b"HTTP/1.1 200 OK echo:one"
        client.send(b"".join(request_parts(b"two")))
        server.protocols[0].timeout_keep_alive_handler()  # before the loop has read it
        answer = await read_answer(client)
        client.close()
        return answer


def test_a_request_waiting_when_the_idle_timeout_fires_is_answered():
    assert asyncio.run(send_before_idle_close()) == b"HTTP/1.1 200 OK echo:two"


async def idle_close_of_a_client_that_never_closes(linger_s: float) -> tuple[bytes, float]:
    """The idle close of a client that keeps its end open: what it reads, and how long the server held on."""
    loop = asyncio.get_running_loop()
    async with Server() as server:
        client = await connect(server.port)
        await loop.sock_sendall(client, b"".join(request_parts(b"one")))
        assert await read_answer(client) == b"HTTP/1.1 200 OK echo:one"
        start = loop.time()
        server.protocols[0].timeout_keep_alive_handler()
        end_of_stream = await asyncio.wait_for(loop.sock_recv(client, 65536), 10)
        await wait_until_async(
            holds(lambda: not server.state.connections), linger_s + 10, "the linger never ended without the client"
        )
        held_s = loop.time() - start
        client.close()
        return end_of_stream, held_s


def test_the_linger_ends_at_its_bound_when_the_client_keeps_its_end_open(monkeypatch):
    monkeypatch.setattr(rest_server, "LINGER_S", 0.3)
    end_of_stream, held_s = asyncio.run(idle_close_of_a_client_that_never_closes(0.3))
    assert end_of_stream == b""  # the FIN came at once
    assert 0.3 <= held_s < 5.0, held_s
