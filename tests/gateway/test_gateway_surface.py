"""What tools find at the gateway: /docs and /openapi.json, gRPC reflection v1 and v1alpha, and one SERVER
root span per call whose trace id the request log line carries (fakes behind a real gateway)."""

import asyncio
import logging

import grpc
import httpx
import pytest
from grpc_reflection.v1alpha import reflection_pb2

from splitserve.protos import generation_pb2, generation_pb2_grpc
from splitserve.runtime import tracing
from splitserve.runtime.grpc_server import build_server
from tests.gateway_fakes import FakeDecode, FakePrefill, Stack, make_tokenizer_dir
from tests.otlp_receiver import Receiver
from tests.service_harness import wait_until

MODEL = "tiny-fake"
KEY = "surface-key"
SERVER, INTERNAL = 2, 1  # OTLP span kinds
REFLECTION = {
    "v1": "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "v1alpha": "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tokenizer")))


def reflect(target: str, version: str, **request) -> reflection_pb2.ServerReflectionResponse:
    """One reflection request over `version`'s method (the messages are the same on the wire)."""
    call = grpc.insecure_channel(target).stream_stream(
        REFLECTION[version],
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    return next(call(iter([reflection_pb2.ServerReflectionRequest(**request)]), timeout=10))


def test_docs_openapi_and_reflection_are_open_with_api_keys(tokenizer_dir):
    stack = Stack(tokenizer_dir, [FakePrefill()], [FakeDecode()], env={"SPLITSERVE_API_KEYS": KEY}).start()
    try:
        schema = httpx.get(stack.base_url + "/openapi.json", timeout=10)
        assert schema.status_code == 200
        assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(schema.json()["paths"])
        docs = httpx.get(stack.base_url + "/docs", timeout=10)
        assert docs.status_code == 200 and "swagger-ui" in docs.text and "/openapi.json" in docs.text
        assert httpx.get(stack.base_url + "/v1/models", timeout=10).status_code == 401  # the API is not
        for version in REFLECTION:
            listed = reflect(stack.grpc_target, version, list_services="")
            assert sorted(s.name for s in listed.list_services_response.service) == [
                "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection",
                "splitserve.v1.Generation",
            ], version
            found = reflect(stack.grpc_target, version, file_containing_symbol="splitserve.v1.Generation")
            assert len(found.file_descriptor_response.file_descriptor_proto) >= 1, version
    finally:
        stack.stop()


def test_an_engine_service_reflects_over_both_versions():
    async def main():
        server, _, port = build_server("127.0.0.1", 0, lambda s: None, ["splitserve.v1.Prefill"])
        await server.start()
        try:
            found = {}
            for version in REFLECTION:
                call = grpc.aio.insecure_channel(f"127.0.0.1:{port}").stream_stream(
                    REFLECTION[version],
                    request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                    response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
                )
                stream = call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
                found[version] = sorted(s.name for s in (await stream.read()).list_services_response.service)
            return found
        finally:
            await server.stop(0)

    names = [
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
        "splitserve.v1.Prefill",
    ]
    assert asyncio.run(main()) == {"v1": names, "v1alpha": names}


@pytest.fixture
def traced():
    """Tracing on in this process, to an in-process OTLP/gRPC receiver; off again afterwards."""
    receiver = Receiver()
    tracing.init_tracing("splitserve-gateway", "gw-test", enabled=True, endpoint=receiver.endpoint)
    yield receiver
    tracing.shutdown()
    tracing.init_tracing("splitserve-gateway", "gw-test", enabled=False)
    receiver.stop()


def test_one_server_root_span_per_call_and_its_trace_id_in_the_request_log(tokenizer_dir, traced, caplog):
    caplog.set_level(logging.INFO, logger="splitserve.requests")
    stack = Stack(tokenizer_dir, [FakePrefill()], [FakeDecode()]).start()
    try:
        body = {"model": MODEL, "prompt": "hello world w20", "max_tokens": 2}
        assert httpx.post(stack.base_url + "/v1/completions", json=body, timeout=10).status_code == 200
        parent = "00f067aa0ba902b7"
        traceparent = f"00-4bf92f3577b34da6a3ce929d0e0e4736-{parent}-01"
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target))
        request = generation_pb2.GenerateRequest(text="hello world w20")
        request.sampling.max_tokens = 2
        assert len(list(stub.Generate(request, metadata=(("traceparent", traceparent),), timeout=10))) == 2
    finally:
        stack.stop()
    tracing.shutdown()  # flushes every span
    spans = traced.spans
    wait_until(lambda: len([s for s in spans if s["name"] == "request"]) == 2, 5, lambda: f"spans: {spans}")
    rest = [s for s in spans if s["name"] == "POST /v1/completions"]
    grpc_call = [s for s in spans if s["name"] == "/splitserve.v1.Generation/Generate"]
    assert len(rest) == len(grpc_call) == 1
    assert [s["kind"] for s in spans if s["kind"] == SERVER] == [SERVER, SERVER]
    assert rest[0]["parent"] == "" and grpc_call[0]["parent"] == parent  # roots: ours, or the caller's
    children = {s["parent"]: s for s in spans if s["name"] == "request"}
    assert set(children) == {rest[0]["span_id"], grpc_call[0]["span_id"]}
    assert all(
        s["kind"] == INTERNAL and s["trace_id"] in (rest[0]["trace_id"], grpc_call[0]["trace_id"])
        for s in children.values()
    )
    assert rest[0]["attributes"]["http.response.status_code"] == 200
    logged = [r.getMessage() for r in caplog.records if r.name == "splitserve.requests"]
    assert [line.split()[1] for line in logged] == [
        f"trace_id={rest[0]['trace_id']}",
        "trace_id=4bf92f3577b34da6a3ce929d0e0e4736",
    ]
