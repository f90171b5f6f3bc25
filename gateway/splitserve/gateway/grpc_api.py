"""The public gRPC API: `splitserve.v1.Generation`, grpc.health.v1 and server reflection.

Generation calls need `authorization: Bearer <key>` metadata when API keys are configured
(UNAUTHENTICATED otherwise); health and reflection stay open. Refusals carry the gRPC code
of their GatewayError and, when the caller may retry, trailing metadata `retry-after`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve.gateway import request_log
from splitserve.gateway.auth import ApiKeys
from splitserve.gateway.errors import GatewayError, invalid
from splitserve.gateway.generation_input import (
    GenerationInput,
    build_sampling_params,
    check_sequences,
    sampling_values_from_proto,
)
from splitserve.gateway.observe import GatewayMetrics
from splitserve.gateway.request_log import RequestLog
from splitserve.gateway.service import GatewayService
from splitserve.protos import generation_pb2
from splitserve.runtime import tracing
from splitserve.runtime.grpc_server import enable_reflection

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def input_from_proto(request: generation_pb2.GenerateRequest, max_stop_strings: int) -> GenerationInput:
    """GenerationInput from a GenerateRequest (INVALID_ARGUMENT naming the field when bad)."""
    values = sampling_values_from_proto(request.sampling)
    values["stop"] = list(request.stop)
    values["include_stop_str_in_output"] = request.include_stop_str_in_output
    values["skip_special_tokens"] = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
    values.setdefault("max_tokens", None)  # unset: up to the context limit (common.proto)
    echo_only = request.echo and values["max_tokens"] == 0  # the prompt alone (generation.proto)
    if echo_only:
        values["max_tokens"] = 1
    params = build_sampling_params(values, max_stop_strings)
    kind = request.WhichOneof("prompt")
    n = request.n if request.HasField("n") else 1
    best_of = request.best_of if request.HasField("best_of") else None
    check_sequences(n, best_of, stream=False)  # a stream either way: with best_of > n, the n messages come last
    common = dict(
        request_id=request.request_id,
        model=request.model,
        params=params,
        priority=request.priority,
        max_tokens_param="max_tokens" if request.sampling.HasField("max_tokens") else None,
        n=n,
        best_of=best_of,
    )
    if request.sampling.HasField("structured_output"):
        member = request.sampling.structured_output.WhichOneof("kind")
        common["structured_field"] = f"sampling.structured_output.{member}"
    if kind == "text":
        return GenerationInput(text=request.text, echo=request.echo, echo_only=echo_only, **common)
    if kind == "token_ids":
        return GenerationInput(token_ids=tuple(request.token_ids.ids), echo=request.echo, echo_only=echo_only, **common)
    if request.echo:
        raise invalid("echo applies to text and token_ids prompts (completions), not to chat", "echo")
    if kind == "chat":
        return GenerationInput(chat=tuple((m.role, m.content) for m in request.chat.messages), **common)
    raise invalid("prompt must be set (text, token_ids or chat)", "prompt")


class GenerationServicer:
    """Generation over the shared GatewayService; methods raise GatewayError for refusals.

    Not registered directly: `generation_handlers` wraps each method with authentication,
    request parsing, the refusal -> status mapping and the requests_total count.
    """

    def __init__(self, service: GatewayService) -> None:
        self._service = service

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext, client_id: str
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        # the call's one SERVER span; the request's own spans are its children
        span = tracing.start_span(
            f"/{GENERATION_SERVICE}/Generate",
            tracing.extract(tracing.metadata_carrier(context.invocation_metadata())),
            {"rpc.system": "grpc", "rpc.service": GENERATION_SERVICE, "rpc.method": "Generate"},
        )
        record = request_log.current()
        if record is not None:
            record.trace_id = tracing.trace_id_of(span)
        error = None
        try:
            inp = input_from_proto(request, self._service.max_stop_strings)
            self._service.check_request_size([inp])
            stream = self._service.generate(
                inp,
                timeout_s=context.time_remaining(),
                client_id=client_id,
                trace_carrier=tracing.inject(span),
                connection=context.peer(),  # the caller's fair share without API keys: one per connection
            )
            try:
                async for message in stream:
                    yield message
            finally:
                await stream.aclose()  # client gone mid-stream: abort on every hop now
        except GatewayError as exc:
            error = f"{exc.grpc_status.name}: {exc.message}"
            raise
        finally:
            tracing.end_span(span, error)

    async def Tokenize(
        self, request: generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext, client_id: str
    ) -> generation_pb2.TokenizeResponse:
        self._service.limiter.take_request(client_id)  # tokenizing is work: it counts against the limits
        self._service.check_model(request.model)
        if request.WhichOneof("input") == "chat":
            ids = await self._service.tokens.tokenize_chat([(m.role, m.content) for m in request.chat.messages])
        else:
            add = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = await self._service.tokens.tokenize_text(request.text, add_special_tokens=add)
        return generation_pb2.TokenizeResponse(token_ids=ids, max_model_len=self._service.registry.max_model_len)

    async def Detokenize(
        self, request: generation_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext, client_id: str
    ) -> generation_pb2.DetokenizeResponse:
        self._service.limiter.take_request(client_id)
        self._service.check_model(request.model)
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else False
        text = await self._service.tokens.detokenize(list(request.token_ids), skip, param="token_ids")
        return generation_pb2.DetokenizeResponse(text=text)

    async def ListModels(
        self, request: generation_pb2.ListModelsRequest, context: grpc.aio.ServicerContext, client_id: str
    ) -> generation_pb2.ListModelsResponse:
        limit = self._service.registry.max_model_len
        models = [generation_pb2.ModelInfo(id=name, max_model_len=limit) for name in self._service.served_names]
        return generation_pb2.ListModelsResponse(models=models)


async def _abort(context: grpc.aio.ServicerContext, exc: GatewayError) -> None:
    metadata = (("retry-after", str(exc.retry_after_s)),) if exc.retry_after_s is not None else ()
    await context.abort(exc.grpc_status, exc.message, trailing_metadata=metadata)


def _parse(raw: bytes, request_type: type) -> Any:
    """The request message from its bytes; INVALID_ARGUMENT (not gRPC's INTERNAL) when malformed."""
    try:
        return request_type.FromString(raw)
    except Exception as exc:  # DecodeError, or RecursionError on absurd nesting
        raise invalid(f"request is not a valid {request_type.DESCRIPTOR.full_name}: {exc}", "request") from None


class _Call:
    """Authentication and accounting of one call: `status` ends as the gRPC code name sent."""

    def __init__(self, gate: _Gate, route: str, context: grpc.aio.ServicerContext) -> None:
        self.gate, self.route, self.context, self.status = gate, route, context, "UNKNOWN"

    def client_id(self) -> str:
        metadata = self.context.invocation_metadata() or ()
        value = next((v for k, v in metadata if k == "authorization"), None)
        return self.gate.api_keys.authenticate(value)

    async def refuse(self, exc: GatewayError) -> None:
        self.status = exc.grpc_status.name
        await _abort(self.context, exc)

    def done(self) -> None:
        if self.gate.metrics is not None:
            self.gate.metrics.count(self.route, self.status)


class _Gate:
    """What every Generation method shares: the servicer, the keys, the metrics, the request log (Generate)."""

    def __init__(
        self,
        servicer: GenerationServicer,
        api_keys: ApiKeys,
        metrics: GatewayMetrics | None,
        request_log: RequestLog | None = None,
    ) -> None:
        self.servicer, self.api_keys, self.metrics = servicer, api_keys, metrics
        self.request_log = request_log or RequestLog(enabled=False)

    def unary(self, name: str, request_type: type) -> grpc.RpcMethodHandler:
        method, route = getattr(self.servicer, name), f"/{GENERATION_SERVICE}/{name}"

        async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            call = _Call(self, route, context)
            try:
                client_id = call.client_id()  # authenticate before looking at the request
                response = await method(_parse(raw, request_type), context, client_id)
                call.status = "OK"
                return response
            except GatewayError as exc:
                await call.refuse(exc)
            except asyncio.CancelledError:
                call.status = "CANCELLED"
                raise
            finally:
                call.done()

        return grpc.unary_unary_rpc_method_handler(handle, response_serializer=_serialize)

    def streaming(self, name: str, request_type: type) -> grpc.RpcMethodHandler:
        method, route = getattr(self.servicer, name), f"/{GENERATION_SERVICE}/{name}"

        async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            call = _Call(self, route, context)
            record, start = self.request_log.open(), time.monotonic()
            try:
                client_id = call.client_id()  # authenticate before looking at the request
                async with aclosing(method(_parse(raw, request_type), context, client_id)) as stream:
                    async for message in stream:
                        yield message
                call.status = "OK"
            except GatewayError as exc:
                await call.refuse(exc)
            except (asyncio.CancelledError, GeneratorExit):
                call.status = "CANCELLED"
                raise
            finally:
                call.done()
                self.request_log.write(record, route, call.status, (time.monotonic() - start) * 1000)

        return grpc.unary_stream_rpc_method_handler(handle, response_serializer=_serialize)


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()


def generation_handlers(
    service: GatewayService,
    api_keys: ApiKeys,
    metrics: GatewayMetrics | None,
    request_log: RequestLog | None = None,
) -> grpc.GenericRpcHandler:
    """The Generation service's handlers: requests arrive as bytes and are parsed by us, so a
    malformed message is INVALID_ARGUMENT; every call is authenticated and counted."""
    gate = _Gate(GenerationServicer(service), api_keys, metrics, request_log)
    handlers = {
        "Generate": gate.streaming("Generate", generation_pb2.GenerateRequest),
        "Tokenize": gate.unary("Tokenize", generation_pb2.TokenizeRequest),
        "Detokenize": gate.unary("Detokenize", generation_pb2.DetokenizeRequest),
        "ListModels": gate.unary("ListModels", generation_pb2.ListModelsRequest),
    }
    return grpc.method_handlers_generic_handler(GENERATION_SERVICE, handlers)


class HealthReporter:
    """Keeps grpc.health.v1 in step with readiness: SERVING while a full path exists."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        self._last: bool | None = None

    async def set_ready(self, ready: bool) -> None:
        if ready == self._last:
            return
        self._last = ready
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", GENERATION_SERVICE):
            await self.servicer.set(service, status)

    async def shutdown(self) -> None:
        await self.servicer.enter_graceful_shutdown()


def add_services(
    server: grpc.aio.Server,
    service: GatewayService,
    health_reporter: HealthReporter,
    api_keys: ApiKeys | None = None,
    metrics: GatewayMetrics | None = None,
    request_log: RequestLog | None = None,
) -> None:
    """Register Generation (authenticated when keys are configured), health and reflection (open)."""
    server.add_generic_rpc_handlers((generation_handlers(service, api_keys or ApiKeys(), metrics, request_log),))
    health_pb2_grpc.add_HealthServicer_to_server(health_reporter.servicer, server)
    enable_reflection(server, [GENERATION_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name])
