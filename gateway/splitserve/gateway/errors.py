"""Errors the gateway answers with, and their gRPC status and HTTP status."""

from __future__ import annotations

import grpc

# kind -> (gRPC status, HTTP status, OpenAI error type)
ERROR_KINDS: dict[str, tuple[grpc.StatusCode, int, str]] = {
    "invalid_argument": (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    "not_found": (grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error"),
    "too_large": (grpc.StatusCode.INVALID_ARGUMENT, 413, "invalid_request_error"),
    "unsupported_media_type": (grpc.StatusCode.INVALID_ARGUMENT, 415, "invalid_request_error"),
    "unauthenticated": (grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_request_error"),
    "rate_limited": (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    "resource_exhausted": (grpc.StatusCode.RESOURCE_EXHAUSTED, 503, "service_unavailable_error"),
    "unavailable": (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
    "deadline_exceeded": (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
    "internal": (grpc.StatusCode.INTERNAL, 500, "server_error"),
    # the client went away before its request was read (nginx's 499: no client sees it; it is counted)
    "client_closed": (grpc.StatusCode.CANCELLED, 499, "invalid_request_error"),
    "request_timeout": (grpc.StatusCode.DEADLINE_EXCEEDED, 408, "timeout_error"),
}

MAX_MESSAGE_CHARS = 1024


class GatewayError(Exception):
    """A request the gateway refuses or cannot serve, before any token was sent.

    `param` names the offending request field (OpenAI's error "param"); `retry_after_s`
    becomes HTTP Retry-After / gRPC trailing metadata "retry-after". Messages longer than
    MAX_MESSAGE_CHARS are cut in the middle (they echo client values, and gRPC carries them
    in trailing metadata, which clients cap at a few KiB).
    """

    def __init__(
        self,
        kind: str,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        if kind not in ERROR_KINDS:
            raise ValueError(f"unknown error kind {kind!r}")
        if len(message) > MAX_MESSAGE_CHARS:
            half = MAX_MESSAGE_CHARS // 2
            message = f"{message[:half]} ...[{len(message) - 2 * half} characters cut]... {message[-half:]}"
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @property
    def grpc_status(self) -> grpc.StatusCode:
        return ERROR_KINDS[self.kind][0]

    @property
    def http_status(self) -> int:
        return ERROR_KINDS[self.kind][1]

    def openai_body(self) -> dict:
        """{"error": {"message", "type", "param", "code"}} as OpenAI's API answers."""
        return {
            "error": {
                "message": self.message,
                "type": ERROR_KINDS[self.kind][2],
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(message: str, param: str | None = None) -> GatewayError:
    """INVALID_ARGUMENT / HTTP 400; `param` defaults to the message's first word."""
    return GatewayError("invalid_argument", message, param=param or message.split(" ", 1)[0])
