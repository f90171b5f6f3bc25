"""The REST shim's HTTP server: uvicorn inside the gateway's event loop, with a timeout on request heads and
keep-alive connections closed only when idle, by a FIN and never a reset."""

from __future__ import annotations

import array
import contextlib
import fcntl
import termios
from typing import Any

from splitserve.gateway.config import GatewayConfig

# How long a connection closed for idleness keeps reading after its FIN, dropping what comes, so that the rest of
# a request the client sent before seeing the FIN (httpx sends the body a loop turn after the head) never meets a
# closed socket (Apache lingers 2 s per read). A client that closes its end on the FIN ends it sooner; one that
# keeps its end open holds a slot of --max-connections this much longer.
LINGER_S = 2.0


def _unread_bytes(transport) -> int:
    """Bytes the kernel has received on the connection that the server has not read yet."""
    count = array.array("i", [0])
    try:
        fcntl.ioctl(transport.get_extra_info("socket").fileno(), termios.FIONREAD, count)
    except (OSError, AttributeError):
        return 0
    return count[0]


def _protocol_with_header_timeout(timeout_s: float) -> type:
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request head within
    `timeout_s` (uvicorn times out idle connections only after a response: 3,000 connections that
    never sent a byte stayed open), and closing an idle keep-alive connection without ever resetting it.

    HTTP/1.1 lets the server close a keep-alive connection idle for its timeout, and a client may be sending
    its next request on it at that moment (it has not seen the FIN yet). uvicorn closes the socket one loop
    turn after its timeout; a request that arrived meanwhile sat unread, and a socket closed with unread data
    answers with a reset: the client (httpx, which writes a request's head and body in two sends) reads
    ECONNRESET, a `ReadError` that says nothing of whether the server took the request. Here the timeout
    serves a request that has arrived (bytes waiting: data_received serves it and cancels the timer);
    otherwise it sends the FIN at once and lingers (as nginx and Apache do): reads and drops what the client
    still sends until the client closes its end, or `LINGER_S`. A request lost to the race then meets a
    clean end of stream with no byte of an answer, which clients read as "the server never took it" (httpx's
    RemoteProtocolError, aiohttp's ServerDisconnectedError) and may send again (RFC 9112 9.3.1: the OpenAI SDK
    does; aiohttp does for idempotent methods only, so a POST of its is lost to the race as with any server)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        _lingering = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(timeout_s, self._head_timed_out)
            self._linger_timer = None

        def connection_lost(self, exc) -> None:
            self._head_timer.cancel()
            if self._linger_timer is not None:
                self._linger_timer.cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if not self._lingering:  # after our FIN, bytes are a request sent before the client saw it: dropped
                super().data_received(data)

        def _head_timed_out(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

        def timeout_keep_alive_handler(self) -> None:
            if self.transport.is_closing() or self._lingering:
                return
            if _unread_bytes(self.transport):  # a request came in after this loop turn's poll: serve it
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )
                return
            if not self.transport.can_write_eof():  # asyncio's TLS transport cannot half-close: uvicorn's close
                super().timeout_keep_alive_handler()
                return
            self.conn.send(h11.ConnectionClosed())
            self._lingering = True
            try:
                self.transport.write_eof()  # the FIN now (after any bytes still buffered); reading goes on
            except OSError:  # the peer is gone already
                self.transport.close()
                return
            # the client's FIN ends it sooner: eof_received returns None, so asyncio closes the transport
            self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)

    return HeaderTimeoutProtocol


def embedded_uvicorn(app: Any, config: GatewayConfig, grace_s: float) -> Any:
    """A uvicorn.Server for `app` on the gateway's REST port that leaves SIGINT/SIGTERM to the gateway."""
    import uvicorn

    class Server(uvicorn.Server):
        def capture_signals(self):  # the gateway owns SIGINT/SIGTERM
            return contextlib.nullcontext()

    tls = dict(ssl_certfile=config.tls_cert, ssl_keyfile=config.tls_key) if config.tls_cert else {}
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.http_port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=max(grace_s, 0.1),
        http=_protocol_with_header_timeout(config.http_header_timeout_s),
        limit_concurrency=config.max_connections,
        timeout_keep_alive=config.http_keep_alive_s,
        **tls,
    )
    return Server(uv_config)
