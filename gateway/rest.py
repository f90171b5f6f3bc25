"""OpenAI-compatible REST shim over the GatewayService (FastAPI; imported only when REST is on).

    GET  /health               200 when a full prefill+decode path (or a colocated worker) serves and the
                               gateway is not draining, else 503 with the reason (vLLM's convention: a client
                               that waits for /health can then list models and send requests)
    GET  /live                 the process answers at all (always 200): for liveness probes
    GET  /ready                /health's answer with the instances' detail
    GET  /v1/models            the served model
    POST /v1/completions       prompt: text or token ids; SSE when stream is true
    POST /v1/chat/completions  messages rendered with the tokenizer's chat template
    GET  /metrics              Prometheus metrics of the gateway (gateway/observe.py)
    POST /tokenize, /detokenize, GET /version   vLLM's token endpoints (gateway/rest_tokens.py)

With API keys configured every route but /health, /live, /ready and /metrics needs
`Authorization: Bearer <key>` (gateway/rest_guard.py).
Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}}. A request is
refused (4xx/5xx) only before its first token; a failure after that is a final SSE event
{"error": ...} (streaming) or HTTP 500 with the error (non-streaming).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from splitserve.gateway.auth import ANONYMOUS, ApiKeys
from splitserve.gateway.errors import GatewayError, invalid
from splitserve.gateway.observe import GatewayMetrics
from splitserve.gateway.rest_guard import CLIENT_ID_KEY, GuardMiddleware, error_response
from splitserve.gateway.rest_params import MAX_JSON_DEPTH, RestRequest, check_json_tree, parse_chat, parse_completion
from splitserve.gateway.rest_tokens import add_token_routes
from splitserve.gateway.service import GatewayService
from splitserve.protos import common_pb2, generation_pb2

FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}
_DISCONNECT_POLL_S = 0.25
BODY_TIMEOUT_S = 30.0  # a body that trickles in slower than this is cut off (HTTP 408)
log = logging.getLogger("splitserve.gateway")


async def read_json(request: Request, max_body_bytes: int) -> Any:
    """The JSON body; HTTP 415 unless sent as application/json, 413 over max_body_bytes, 400 when not
    UTF-8 JSON. (Requiring the JSON media type also means a web page cannot POST here without a CORS
    preflight: text/plain is a "simple" request a browser sends anywhere.)"""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        shown = media_type[:64] or "none"
        raise GatewayError(
            "unsupported_media_type",
            f"Content-Type must be application/json, got {shown}",
            param="Content-Type",
        )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        raise _too_large(int(declared), max_body_bytes)
    try:
        raw = await asyncio.wait_for(_read_body(request, max_body_bytes), BODY_TIMEOUT_S)
    except ClientDisconnect:
        log.info("client %s closed the connection while sending its request body", _client(request))
        raise GatewayError("client_closed", "the client closed the connection while sending the body") from None
    except TimeoutError:
        raise GatewayError(
            "request_timeout", f"the request body did not arrive within {BODY_TIMEOUT_S:g} s", param="body"
        ) from None
    try:
        body = json.loads(raw)
    except UnicodeDecodeError as exc:
        raise invalid(f"request body is not valid UTF-8: {exc}", "body") from None
    except ValueError as exc:
        raise invalid(f"request body is not valid JSON: {exc}", "body") from None
    except RecursionError:
        raise invalid(
            f"request body nests deeper than {MAX_JSON_DEPTH} levels; the request body may have at most "
            f"{MAX_JSON_DEPTH}",
            "body",
        ) from None
    check_json_tree(body)
    return body


async def _read_body(request: Request, max_body_bytes: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise _too_large(size, max_body_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _client(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "?"


def _too_large(size: int, limit: int) -> GatewayError:
    return GatewayError(
        "too_large",
        f"request body has more than {limit} bytes (got at least {size}); the limit is max_body_bytes={limit}",
        param="body",
        code="request_too_large",
    )


class _Shape:
    """OpenAI response shapes of one endpoint (completions or chat)."""

    def __init__(self, chat: bool, tokenizer: Any, model: str, request_id: str, top: int | None) -> None:
        self.chat, self.tokenizer, self.model, self.id, self.top = chat, tokenizer, model, request_id, top
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._text_offset = 0

    def envelope(self, choices: list, object_suffix: str = "") -> dict:
        return {
            "id": self.id,
            "object": self.object + object_suffix,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def logprobs(self, message: generation_pb2.GenerateResponse) -> dict | None:
        if self.top is None:
            return None
        entries = [(self._token(lp.token_id), lp) for lp in message.logprobs]
        if self.chat:
            return {
                "content": [
                    {
                        "token": tok,
                        "logprob": lp.logprob,
                        "bytes": list(tok.encode()),
                        "top_logprobs": [
                            {
                                "token": self._token(t.token_id),
                                "logprob": t.logprob,
                                "bytes": list(self._token(t.token_id).encode()),
                            }
                            for t in lp.top
                        ],
                    }
                    for tok, lp in entries
                ]
            }
        # offsets into the output text: tokens of one message share its text span
        start, end = self._text_offset, self._text_offset + len(message.text)
        offsets, position = [], start
        for tok, _ in entries:
            offsets.append(min(position, end))
            position += len(tok)
        self._text_offset = end
        return {
            "tokens": [tok for tok, _ in entries],
            "token_logprobs": [lp.logprob for _, lp in entries],
            "top_logprobs": [{self._token(t.token_id): t.logprob for t in lp.top} for _, lp in entries],
            "text_offset": offsets,
        }

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def usage_dict(usage: common_pb2.Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def _server_error(message: str) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}


def _merge_logprobs(shape: _Shape, parts: list[dict]) -> dict | None:
    if shape.top is None:
        return None
    if shape.chat:
        return {"content": [entry for part in parts for entry in part["content"]]}
    return {
        key: [x for part in parts for x in part[key]]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }


async def _complete(
    shape: _Shape, first: generation_pb2.GenerateResponse, stream: AsyncIterator[generation_pb2.GenerateResponse]
) -> JSONResponse:
    """Non-streaming answer: every message merged into one choice."""
    texts, logprobs, last = [], [], first
    message = first
    while True:
        texts.append(message.text)
        if shape.top is not None:
            logprobs.append(shape.logprobs(message))
        last = message
        if message.finish_reason:
            break
        message = await stream.__anext__()
    if last.finish_reason == common_pb2.FINISH_REASON_ERROR:
        return JSONResponse(_server_error(last.error), status_code=500)
    text = "".join(texts)
    choice: dict[str, Any] = {
        "index": 0,
        "logprobs": _merge_logprobs(shape, logprobs),
        "finish_reason": FINISH_NAMES[last.finish_reason],
        "stop_reason": last.stop_reason or None,
    }
    if shape.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    body = shape.envelope([choice])
    body["usage"] = usage_dict(last.usage)
    return JSONResponse(body)


async def _sse(
    shape: _Shape,
    req: RestRequest,
    first: generation_pb2.GenerateResponse,
    stream: AsyncIterator[generation_pb2.GenerateResponse],
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per message, then usage (if asked) and [DONE]."""
    try:
        if shape.chat:
            yield _event(
                shape.envelope(
                    [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    ".chunk",
                )
            )
        message = first
        while True:
            if message.finish_reason == common_pb2.FINISH_REASON_ERROR:
                yield _event(_server_error(message.error))
                break
            finish = FINISH_NAMES.get(message.finish_reason)
            if message.text or finish or (shape.top is not None and message.token_ids):
                choice: dict[str, Any] = {"index": 0, "logprobs": shape.logprobs(message), "finish_reason": finish}
                if shape.chat:
                    choice["delta"] = {"content": message.text} if message.text else {}
                else:
                    choice["text"] = message.text
                if finish:
                    choice["stop_reason"] = message.stop_reason or None
                chunk = shape.envelope([choice], ".chunk" if shape.chat else "")
                if req.continuous_usage:
                    chunk["usage"] = usage_dict(message.usage)
                yield _event(chunk)
            if finish:
                if req.include_usage:
                    body = shape.envelope([], ".chunk" if shape.chat else "")
                    body["usage"] = usage_dict(message.usage)
                    yield _event(body)
                break
            message = await stream.__anext__()
        yield "data: [DONE]\n\n"
    finally:
        await stream.aclose()  # client gone: abort the request on every hop


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def _until_disconnect(request: Request, work: asyncio.Future) -> None:
    while not work.done():
        await asyncio.wait({work}, timeout=_DISCONNECT_POLL_S)
        if not work.done() and await request.is_disconnected():
            work.cancel()


def create_app(
    service: GatewayService,
    max_body_bytes: int,
    started_unix_s: int | None = None,
    *,
    api_keys: ApiKeys | None = None,
    metrics: GatewayMetrics | None = None,
) -> FastAPI:
    """The FastAPI app serving the OpenAI-compatible endpoints (and /metrics) over `service`."""
    app = FastAPI(title="splitserve gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(GuardMiddleware, api_keys=api_keys or ApiKeys(), metrics=metrics)
    created = started_unix_s or int(time.time())

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # unknown path, wrong method
        body = {
            "error": {
                "message": f"{exc.detail}: {request.method} {request.url.path}",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        }
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    async def generate(request: Request, parse: Callable, chat: bool):
        prefix = "chatcmpl" if chat else "cmpl"
        try:
            body = await read_json(request, max_body_bytes)
            req: RestRequest = parse(body, f"{prefix}-{uuid.uuid4().hex}", service.max_stop_strings)
            stream = service.generate(
                req.inp,
                client_id=request.scope.get(CLIENT_ID_KEY, ANONYMOUS),
                trace_carrier={k: v for k, v in request.headers.items() if k in ("traceparent", "tracestate")},
            )
            first = await stream.__anext__()
        except GatewayError as exc:
            return error_response(exc)
        shape = _Shape(chat, service.tokenizer, req.inp.model or service.model_id, req.inp.request_id, req.logprobs)
        if req.stream:
            return StreamingResponse(
                _sse(shape, req, first, stream), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        work = asyncio.ensure_future(_complete(shape, first, stream))
        try:
            await _until_disconnect(request, work)
        finally:
            if not work.done():
                work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            await stream.aclose()  # runs the request's cleanup now, not at garbage collection
        if work.cancelled():
            return JSONResponse(_server_error("client disconnected"), status_code=499)
        return work.result()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, parse_completion, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, parse_chat, chat=True)

    add_token_routes(app, service, lambda request: read_json(request, max_body_bytes))

    @app.get("/v1/models")
    async def models():
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "splitserve",
                "root": service.model_id,
                "parent": None,
                "max_model_len": service.registry.max_model_len,
            }
            for name in service.served_names
        ]
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def prometheus_metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if metrics is None:
            return JSONResponse(_server_error("metrics are off"), status_code=404)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def readiness() -> dict:
        status = service.registry.status()
        if service.draining:
            status["ready"] = False
        if not status["ready"]:
            status["reason"] = (
                "the gateway is shutting down" if service.draining else service.registry.not_ready_reason()
            )
        return status

    @app.get("/health")
    async def health(request: Request):
        status = readiness()
        if status["ready"]:
            return {"status": "ok"}
        body = {"status": "unavailable"}
        if may_see_internals(request):
            body["reason"] = status["reason"]
        return JSONResponse(body, status_code=503)

    @app.get("/live")
    async def live():
        return {"status": "ok"}

    def may_see_internals(request: Request) -> bool:
        """/health and /ready are open for probes; with API keys set, the instances' addresses and
        errors only for key holders."""
        keys = api_keys or ApiKeys()
        if not keys.num_keys:
            return True
        try:
            keys.authenticate(request.headers.get("authorization"))
        except GatewayError:
            return False
        return True

    @app.get("/ready")
    async def ready(request: Request):
        status = readiness()
        code = 200 if status["ready"] else 503
        if not may_see_internals(request):
            return JSONResponse({"ready": status["ready"]}, status_code=code)
        return JSONResponse(status, status_code=code)

    return app
