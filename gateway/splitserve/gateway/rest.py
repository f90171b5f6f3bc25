"""OpenAI-compatible REST shim over the GatewayService (FastAPI; imported only when REST is on).

    GET  /health               200 when a full prefill+decode path (or a colocated worker) serves and the
                               gateway is not draining, else 503 with the reason (vLLM's convention: a client
                               that waits for /health can then list models and send requests)
    GET  /live                 the process answers at all (always 200): for liveness probes
    GET  /ready                /health's answer with the instances' detail
    GET  /v1/models            the served model
    POST /v1/completions       prompt: text or token ids; SSE when stream is true
    POST /v1/chat/completions  messages rendered with the tokenizer's chat template; tools (gateway/rest_tools.py)
    POST /v1/responses         OpenAI's Responses API, stateless (gateway/rest_responses.py)
    GET  /metrics              Prometheus metrics of the gateway (gateway/observe.py)
    POST /tokenize, /detokenize, GET /version   vLLM's token endpoints (gateway/rest_tokens.py)
    GET  /docs, /openapi.json  the API's Swagger UI and OpenAPI schema (open, as vLLM's)

With API keys configured every route but /health, /live, /ready, /metrics, /docs and /openapi.json needs
`Authorization: Bearer <key>` (gateway/rest_guard.py).
Bodies are validated by the pydantic models of gateway/rest_models.py; a refused body is HTTP 400 (as
vLLM's server answers a validation error; FastAPI's default would be 422) naming the field and the limit.
`n` > 1 gives n choices per prompt (choice i * n + j = prompt i's sequence j), from one prefill
(gateway/sequences.py). Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}}. A request is
refused (4xx/5xx) only before its first token; a failure after that is a final SSE event
{"error": ...} (streaming) or HTTP 500 with the error (non-streaming).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from splitserve.gateway.auth import ANONYMOUS, ApiKeys
from splitserve.gateway.errors import GatewayError, invalid
from splitserve.gateway.observe import GatewayMetrics
from splitserve.gateway.request_log import RequestLog
from splitserve.gateway.request_log import current as current_record
from splitserve.gateway.rest_answer_parts import complete
from splitserve.gateway.rest_answers import Shape, server_error, sse
from splitserve.gateway.rest_guard import CLIENT_ID_KEY, SPAN_KEY, GuardMiddleware, error_response
from splitserve.gateway.rest_params import MAX_JSON_DEPTH, RestRequest, check_json_tree, parse_chat, parse_completion
from splitserve.gateway.rest_responses import parse_responses
from splitserve.gateway.rest_responses_answers import ResponsesAnswer
from splitserve.gateway.rest_tokens import add_token_routes
from splitserve.gateway.rest_tools import ToolSettings
from splitserve.gateway.sequences import Split
from splitserve.gateway.service import GatewayService
from splitserve.runtime import tracing

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


class _Opening:
    """Every choice's first message: each prompt's first, then with n > 1 the first of each of its sequences
    (gateway/sequences.py `Split`). All of it runs under the disconnect watch, since a fork's first token
    comes only from a decode step: a client that leaves while any is missing stops every sequence."""

    def __init__(self, streams: list, n: int) -> None:
        self.streams, self.n = streams, n
        self.splits: list[Split] = []

    async def firsts(self) -> tuple[list, list]:
        """(first messages, streams), one per choice; a refusal of any prompt is raised."""
        firsts = await asyncio.gather(*(s.__anext__() for s in self.streams), return_exceptions=True)
        _raise_any(firsts)
        if self.n == 1:
            return firsts, self.streams
        self.splits = [Split(first, stream, self.n) for first, stream in zip(firsts, self.streams)]
        parts = [part for split in self.splits for part in split.parts]  # choice i * n + j: prompt i, sequence j
        firsts = await asyncio.gather(*(part.__anext__() for part in parts), return_exceptions=True)
        _raise_any(firsts)
        return firsts, parts

    async def aclose(self) -> None:
        """Abort every sequence of every prompt, whichever parts had started."""
        for split in self.splits:
            await split.aclose()
        for stream in self.streams:
            await stream.aclose()  # the requests' cleanup: abort at the prefill or decode, release what they held


def _raise_any(results: list) -> None:
    refused = next((r for r in results if isinstance(r, BaseException)), None)
    if refused is not None:  # one prompt refused: the whole request is, and the others stop
        raise refused


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
    tool_settings: ToolSettings | None = None,
    request_log: RequestLog | None = None,
) -> FastAPI:
    """The FastAPI app serving the OpenAI-compatible endpoints (and /metrics) over `service`."""
    # FastAPI's own OpenTelemetry (0.165+) would open a second SERVER span per call beside ours (rest_guard.py)
    native = {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" not in inspect.signature(FastAPI).parameters:
        native = {}
    app = FastAPI(title="splitserve gateway", docs_url="/docs", redoc_url=None, openapi_url="/openapi.json", **native)
    app.add_middleware(GuardMiddleware, api_keys=api_keys or ApiKeys(), metrics=metrics, request_log=request_log)
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

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        """A body the request models refuse (gateway/rest_models.py): HTTP 400 as vLLM answers (FastAPI's
        default is 422), OpenAI's error shape, the first error's message and top-level field."""
        first = exc.errors()[0]
        return error_response(invalid(first["msg"], str(first["loc"][0]) if first["loc"] else "body"))

    async def generate(request: Request, parse: Callable, chat: bool, respond: type | None = None):
        """One request of an OpenAI endpoint; `respond` builds another API's answers (the Responses API)."""
        prefix = "resp" if respond is not None else "chatcmpl" if chat else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        record = current_record()
        if record is not None:  # the log line names the id also when the body is refused
            record.add_request(request_id, 0)
        streams: list = []
        try:
            body = await read_json(request, max_body_bytes)
            req: RestRequest = parse(body, request_id, service.max_stop_strings)
            inputs = [req.inp, *req.more]  # a batch of prompts: one request each, run side by side
            service.check_request_size(inputs)
            span = request.scope.get(SPAN_KEY)  # the request's spans are children of the call's SERVER span
            carrier = tracing.inject(span) if span is not None else {}
            client_id = request.scope.get(CLIENT_ID_KEY, ANONYMOUS)
            connection = _client(request)  # the caller's fair share without API keys: one per connection
            streams = [
                service.generate(inp, client_id=client_id, trace_carrier=carrier, connection=connection)
                for inp in inputs
            ]
            # watched for the client leaving from the start: one that leaves before its first token aborts the
            # request wherever it is (queued, prefilling, handed to a decode), not only at its first token
            opening = _Opening(streams, req.n)
            first_work = asyncio.ensure_future(opening.firsts())  # a task: cancelled() says it was
            try:
                await _until_disconnect(request, first_work)
            finally:
                if not first_work.done():
                    first_work.cancel()
                await asyncio.gather(first_work, return_exceptions=True)
            if first_work.cancelled() or first_work.exception() is not None:
                await opening.aclose()
            if first_work.cancelled():
                return JSONResponse(server_error("client disconnected"), status_code=499)
            firsts, streams = first_work.result()
        except GatewayError as exc:
            return error_response(exc)
        model = service.reported_name or req.inp.model
        answer = respond(req, model) if respond is not None else None
        with_prompt_logprobs = req.inp.params.prompt_logprobs is not None
        shapes = [
            Shape(
                chat,
                service.tokenizer,
                model,
                req.inp.request_id,
                req.logprobs,
                req.inp.echo,
                with_prompt_logprobs,
                tools=req.tools,
            )
            for _ in streams
        ]
        if req.stream:
            events = answer.sse(firsts, streams) if answer is not None else sse(shapes, req, firsts, streams)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        work = asyncio.ensure_future(
            answer.complete(firsts, streams) if answer is not None else complete(shapes, firsts, streams)
        )
        try:
            await _until_disconnect(request, work)
        finally:
            if not work.done():
                work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            for stream in streams:
                await stream.aclose()  # runs the request's cleanup now, not at garbage collection
        if work.cancelled():
            return JSONResponse(server_error("client disconnected"), status_code=499)
        if isinstance(work.exception(), GatewayError):  # refused after the first tokens (a decode that took
            return error_response(work.exception())  # nothing): its own status, e.g. 503, never a bare 500
        return work.result()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, parse_completion, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, partial(parse_chat, tool_settings=tool_settings), chat=True)

    @app.post("/v1/responses")
    async def responses(request: Request):
        parse = partial(parse_responses, tool_settings=tool_settings)
        return await generate(request, parse, chat=True, respond=ResponsesAnswer)

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
            return JSONResponse(server_error("metrics are off"), status_code=404)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def readiness() -> dict:
        status = service.registry.status()
        lagging = service.processes_not_ready() if status["ready"] and not service.draining else []
        if service.draining:
            status["ready"], status["reason"] = False, "the gateway is shutting down"
        elif lagging:  # a client told "ready" here must not be refused by a process of the same gateway
            status["ready"] = False
            status["reason"] = f"gateway processes {lagging} have not found a full path yet"
        elif not status["ready"]:
            status["reason"] = service.registry.not_ready_reason()
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
