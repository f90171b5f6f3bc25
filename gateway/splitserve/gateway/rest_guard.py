"""ASGI middleware in front of the REST shim: API-key authentication and requests_total.

Every HTTP call except /health, /live, /ready and /metrics must carry `Authorization: Bearer <key>`
when keys are configured; otherwise it is answered here with 401, OpenAI's error shape and
`WWW-Authenticate: Bearer`. The caller's client id is put in the ASGI scope under
CLIENT_ID_KEY for the rate limits. Each call is counted once in requests_total with its
route (the path for the shim's own routes, "other" for anything else, so random paths
cannot grow the label set) and the HTTP status it was answered with (/metrics itself is not
counted). A pure ASGI middleware (not BaseHTTPMiddleware) so streaming and client
disconnects pass through untouched.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import JSONResponse

from splitserve.gateway.auth import OPEN_HTTP_PATHS, ApiKeys
from splitserve.gateway.errors import GatewayError
from splitserve.gateway.observe import GatewayMetrics
from splitserve.gateway.request_log import RequestLog
from splitserve.runtime import tracing

CLIENT_ID_KEY = "splitserve.client_id"
SPAN_KEY = "splitserve.span"  # the call's SERVER span in the ASGI scope (None when tracing is off)
ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/version",
        "/health",
        "/live",
        "/ready",
        "/metrics",
        "/docs",
        "/openapi.json",
    }
)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


def error_response(exc: GatewayError) -> JSONResponse:
    """The OpenAI-shaped error with its status, Retry-After and (401) WWW-Authenticate headers."""
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    if exc.http_status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(exc.openai_body(), status_code=exc.http_status, headers=headers or None)


class GuardMiddleware:
    """Authenticates and counts every HTTP call to the wrapped app; writes the request log line of every
    POST (the calls that ask the model for something)."""

    def __init__(
        self, app: Callable, api_keys: ApiKeys, metrics: GatewayMetrics | None, request_log: RequestLog | None = None
    ) -> None:
        self.app, self.api_keys, self.metrics = app, api_keys, metrics
        self.request_log = request_log or RequestLog(enabled=False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in ROUTES else "other"
        post = scope.get("method") == "POST"
        record = self.request_log.open() if post else None
        span = _server_span(scope, route) if post else None  # the call's one SERVER span
        scope[SPAN_KEY] = span
        if record is not None:
            record.trace_id = tracing.trace_id_of(span)
        start = time.monotonic()
        status = [500]  # what an exception escaping the app becomes

        async def send_counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if path not in OPEN_HTTP_PATHS:
                try:
                    scope[CLIENT_ID_KEY] = self.api_keys.authenticate(_header(scope, b"authorization"))
                except GatewayError as exc:
                    await error_response(exc)(scope, receive, send_counted)
                    return
            await self.app(scope, receive, send_counted)
        finally:
            if self.metrics is not None and path != "/metrics":
                self.metrics.count(route, status[0])
            self.request_log.write(record, route, status[0], (time.monotonic() - start) * 1000)
            if span is not None:
                span.set_attribute("http.response.status_code", status[0])
                tracing.end_span(span, f"HTTP {status[0]}" if status[0] >= 500 else None)


def _server_span(scope: Scope, route: str):
    """A SERVER span for the call, child of the client's traceparent when it sent one (a no-op when off)."""
    if not tracing.enabled():
        return None
    carrier = {}
    for key in ("traceparent", "tracestate"):
        value = _header(scope, key.encode())
        if value is not None:
            carrier[key] = value.decode("latin-1")
    attributes = {"http.request.method": "POST", "http.route": route, "url.path": scope.get("path", "")[:256]}
    return tracing.start_span(f"POST {route}", tracing.extract(carrier), attributes, kind="server")


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None
