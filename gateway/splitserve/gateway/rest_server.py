"""The REST shim's HTTP server: uvicorn inside the gateway's event loop, with a timeout on request heads and
keep-alive connections closed only when idle."""

from __future__ import annotations

import array
import contextlib
import fcntl
import socket
import termios
from typing import Any

from splitserve.gateway.config import GatewayConfig


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
    never sent a byte stayed open), and closing an idle keep-alive connection only when it is idle.

    uvicorn's keep-alive timeout closes the transport, and asyncio closes the socket one loop turn later:
    under load that turn takes milliseconds, during which the client, seeing no FIN, may send its next
    request on the connection; the kernel then answers the socket's close with unread data by a reset,
    and the client loses a request the server had received. Here the timeout leaves alone a connection
    whose next request has arrived (data_received serves it and cancels the timer), and sends the FIN at
    once, so a client that reuses the connection afterwards sees a clean close before any request of its
    is taken, never a reset."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(timeout_s, self._head_timed_out)

        def connection_lost(self, exc) -> None:
            self._head_timer.cancel()
            super().connection_lost(exc)

        def _head_timed_out(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

        def timeout_keep_alive_handler(self) -> None:
            if self.transport.is_closing():
                return
            if _unread_bytes(self.transport):  # a request came in after this loop turn's poll: serve it
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )
                return
            plain = self.transport.get_extra_info("sslcontext") is None  # TLS closes with its own close_notify
            if plain and not self.transport.get_write_buffer_size():  # nothing left to send: the FIN now
                with contextlib.suppress(OSError):
                    self.transport.get_extra_info("socket").shutdown(socket.SHUT_WR)
            super().timeout_keep_alive_handler()

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
