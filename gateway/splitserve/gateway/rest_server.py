"""The REST shim's HTTP server: uvicorn inside the gateway's event loop, with a timeout on request heads."""

from __future__ import annotations

import contextlib
from typing import Any

from splitserve.gateway.config import GatewayConfig


def _protocol_with_header_timeout(timeout_s: float) -> type:
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request head within
    `timeout_s` (uvicorn times out idle connections only after a response: 3,000 connections that
    never sent a byte stayed open)."""
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
