"""The public gRPC API: `splitserve.v1.Generation`, grpc.health.v1 and server reflection."""

from __future__ import annotations

from typing import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.errors import GatewayError, invalid
from gateway.service import GatewayService, GenerationInput, build_sampling_params, sampling_values_from_proto
from protos import generation_pb2, generation_pb2_grpc

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def input_from_proto(request: generation_pb2.GenerateRequest, max_stop_strings: int) -> GenerationInput:
    """GenerationInput from a GenerateRequest (INVALID_ARGUMENT naming the field when bad)."""
    values = sampling_values_from_proto(request.sampling)
    values["stop"] = list(request.stop)
    values["include_stop_str_in_output"] = request.include_stop_str_in_output
    values["skip_special_tokens"] = (request.skip_special_tokens
                                     if request.HasField("skip_special_tokens") else True)
    params = build_sampling_params(values, max_stop_strings)
    kind = request.WhichOneof("prompt")
    common = dict(request_id=request.request_id, model=request.model, params=params, priority=request.priority)
    if kind == "text":
        return GenerationInput(text=request.text, **common)
    if kind == "token_ids":
        return GenerationInput(token_ids=tuple(request.token_ids.ids), **common)
    if kind == "chat":
        return GenerationInput(chat=tuple((m.role, m.content) for m in request.chat.messages), **common)
    raise invalid("prompt must be set (text, token_ids or chat)", "prompt")


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Generation over the shared GatewayService; refusals become gRPC status codes."""

    def __init__(self, service: GatewayService) -> None:
        self._service = service

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        try:
            inp = input_from_proto(request, self._service.max_stop_strings)
        except GatewayError as exc:
            await _abort(context, exc)
        stream = self._service.generate(inp, timeout_s=context.time_remaining())
        try:
            async for message in stream:
                yield message
        except GatewayError as exc:
            await _abort(context, exc)
        finally:
            await stream.aclose()  # client gone mid-stream: abort on every hop now

    async def Tokenize(self, request: generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
                       ) -> generation_pb2.TokenizeResponse:
        try:
            self._service.check_model(request.model)
            if request.WhichOneof("input") == "chat":
                turns = [(m.role, m.content) for m in request.chat.messages]
                ids = self._service.tokenize_chat(turns)
            else:
                ids = self._service.tokenize_text(request.text)
        except GatewayError as exc:
            await _abort(context, exc)
        return generation_pb2.TokenizeResponse(token_ids=ids, max_model_len=self._service.registry.max_model_len)

    async def ListModels(self, request: generation_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
                         ) -> generation_pb2.ListModelsResponse:
        model_id = self._service.model_id
        models = [generation_pb2.ModelInfo(id=model_id, max_model_len=self._service.registry.max_model_len)] if model_id else []
        return generation_pb2.ListModelsResponse(models=models)


async def _abort(context: grpc.aio.ServicerContext, exc: GatewayError) -> None:
    metadata = (("retry-after", str(exc.retry_after_s)),) if exc.retry_after_s is not None else ()
    await context.abort(exc.grpc_status, exc.message, trailing_metadata=metadata)


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


def add_services(server: grpc.aio.Server, service: GatewayService, health_reporter: HealthReporter) -> None:
    """Register Generation, health and reflection on `server`."""
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(service), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_reporter.servicer, server)
    names = (GENERATION_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
