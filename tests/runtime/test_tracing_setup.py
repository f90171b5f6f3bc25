"""Tracing set up from the standard OTEL_* variables and --otlp-traces-endpoint: which exporters, where the
spans go (as the banner says), and spans reaching an in-process OTLP/HTTP receiver and the console."""

import json

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

from splitserve.cli.supervisor import banner
from splitserve.gateway.config import UpConfig
from splitserve.runtime import tracing
from splitserve.runtime.otlp_http import OtlpHttpSpanExporter, parse_headers
from tests.otlp_receiver import HttpReceiver

GRPC_ENV = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}


@pytest.mark.parametrize(
    "env, endpoint, where",
    [
        ({}, "", "off"),
        ({"SPLITSERVE_TRACING": "1"}, "", "OTLP/gRPC http://localhost:4317"),
        (GRPC_ENV, "", "OTLP/gRPC http://collector:4317"),
        ({}, "http://c:4317", "OTLP/gRPC http://c:4317"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", **GRPC_ENV}, "", "OTLP/HTTP http://collector:4317/v1/traces"),
        ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, "http://c:4318/x", "OTLP/HTTP http://c:4318/x"),
        ({"OTEL_TRACES_EXPORTER": "console"}, "", "console (stdout)"),
        ({"OTEL_TRACES_EXPORTER": "console,otlp"}, "", "console (stdout), OTLP/gRPC http://localhost:4317"),
        ({"OTEL_TRACES_EXPORTER": "none", **GRPC_ENV}, "http://c:4317", "off"),
    ],
)
def test_where_spans_go(env, endpoint, where):
    assert tracing.destination(env, endpoint) == where
    assert tracing.tracing_requested(env, endpoint) is (where != "off")


def test_the_exporters_each_setting_builds():
    (grpc_exporter,) = tracing.make_exporters(GRPC_ENV, "")
    assert isinstance(grpc_exporter, OTLPSpanExporter)
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_HEADERS": "a=1,b=x%20y"}
    (http_exporter,) = tracing.make_exporters(env, "")
    assert isinstance(http_exporter, OtlpHttpSpanExporter)
    assert http_exporter.endpoint == "http://localhost:4318/v1/traces"
    assert http_exporter.headers == {"Content-Type": "application/x-protobuf", "a": "1", "b": "x y"}
    console, otlp = tracing.make_exporters({"OTEL_TRACES_EXPORTER": "console,otlp"}, "http://c:4317")
    assert isinstance(console, ConsoleSpanExporter) and isinstance(otlp, OTLPSpanExporter)
    assert parse_headers("") == {}


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"OTEL_TRACES_EXPORTER": "zipkin"},
            "OTEL_TRACES_EXPORTER='zipkin' is not supported; use one of otlp, console, none",
        ),
        (
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "OTEL_EXPORTER_OTLP_PROTOCOL='http/json' is not supported; use one of grpc, http/protobuf",
        ),
    ],
)
def test_an_unsupported_setting_is_named(env, message):
    with pytest.raises(ValueError) as info:
        tracing.destination({**env, **GRPC_ENV})
    assert str(info.value) == message


def test_spans_reach_an_otlp_http_receiver():
    receiver = HttpReceiver()
    try:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(OtlpHttpSpanExporter(receiver.endpoint + "/v1/traces")))
        with provider.get_tracer("t").start_as_current_span("outer"):
            with provider.get_tracer("t").start_as_current_span("inner"):
                pass
        provider.shutdown()
        assert receiver.paths == [("/v1/traces", "application/x-protobuf")] * 2
        inner, outer = receiver.spans
        assert (inner["name"], outer["name"], inner["parent"]) == ("inner", "outer", outer["span_id"])
    finally:
        receiver.stop()


def test_console_traces_print_each_span(monkeypatch, capsys):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert tracing.init_tracing("splitserve-test", "t0") is True
    try:
        with tracing.span("console-span", kind="server"):
            pass
        tracing.shutdown()
    finally:
        tracing.init_tracing("splitserve-test", "t0", enabled=False)
    printed = json.loads(capsys.readouterr().out)
    assert (printed["name"], printed["kind"]) == ("console-span", "SpanKind.SERVER")
    assert printed["resource"]["attributes"]["service.name"] == "splitserve-test"


def test_the_banner_says_where_traces_go():
    where = tracing.destination({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "http://c:4318/v1/traces")
    assert "  traces       OTLP/HTTP http://c:4318/v1/traces" in banner(UpConfig(), "m", traces=where).splitlines()
    off = "  traces       off (--otlp-traces-endpoint or OTEL_EXPORTER_OTLP_ENDPOINT turns them on)"
    assert off in banner(UpConfig(), "m").splitlines()
