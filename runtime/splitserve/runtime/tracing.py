"""OpenTelemetry tracing, off unless asked for, with no import of OpenTelemetry when off.

On: `--otlp-traces-endpoint` (vLLM's flag), `SPLITSERVE_TRACING=1`, `OTEL_EXPORTER_OTLP_ENDPOINT` /
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or `OTEL_TRACES_EXPORTER` set (to anything but `none`). Where spans go
follows the standard variables: `OTEL_TRACES_EXPORTER` = `otlp` (default), `console` or both (comma-separated),
`none`; `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL` = `grpc` (default) or
`http/protobuf` (otlp_http.py); endpoints, headers and TLS from the usual `OTEL_EXPORTER_OTLP_*` variables.
Context crosses processes as W3C `traceparent`: in gRPC metadata for unary calls, and in
`DecodeRequest.trace_context` on the shared decode stream.

Spans whose times are known only afterwards (queueing, compute inside the engine core) are
recorded with explicit start/end times, so the hot path never waits on tracing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

_tracer = None
_provider = None
_enabled = False
EXPORTERS = ("otlp", "console", "none")
PROTOCOLS = ("grpc", "http/protobuf")


def _exporter_names(env: Mapping[str, str]) -> list[str]:
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()] or ["otlp"]
    bad = [n for n in names if n not in EXPORTERS]
    if bad:
        raise ValueError(f"OTEL_TRACES_EXPORTER={bad[0]!r} is not supported; use one of {', '.join(EXPORTERS)}")
    return names


def _protocol(env: Mapping[str, str]) -> str:
    variable = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
    if not env.get(variable):
        variable = "OTEL_EXPORTER_OTLP_PROTOCOL"
    protocol = env.get(variable, "").strip().lower() or "grpc"
    if protocol not in PROTOCOLS:
        raise ValueError(f"{variable}={protocol!r} is not supported; use one of {', '.join(PROTOCOLS)}")
    return protocol


def _otlp_endpoint(env: Mapping[str, str], endpoint: str, protocol: str) -> str:
    """The collector URL: the flag or the traces variable as given, else the base endpoint (+ /v1/traces for
    HTTP), else the default port of the protocol on localhost."""
    given = endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
    if given:
        return given
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    if protocol == "grpc":
        return base or "http://localhost:4317"
    return (base.rstrip("/") or "http://localhost:4318") + "/v1/traces"


def tracing_requested(env: Mapping[str, str] | None = None, endpoint: str = "") -> bool:
    env = os.environ if env is None else env
    if _exporter_names(env) == ["none"]:
        return False
    return bool(
        endpoint
        or env.get("SPLITSERVE_TRACING", "").lower() in ("1", "true", "yes", "on")
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or env.get("OTEL_TRACES_EXPORTER")
    )


def destination(env: Mapping[str, str] | None = None, endpoint: str = "") -> str:
    """Where spans go, in words ("off" when tracing is off), for banners and the start-up log."""
    env = os.environ if env is None else env
    if not tracing_requested(env, endpoint):
        return "off"
    where = []
    for name in _exporter_names(env):
        if name == "console":
            where.append("console (stdout)")
        elif name == "otlp":
            protocol = _protocol(env)
            kind = "OTLP/gRPC" if protocol == "grpc" else "OTLP/HTTP"
            where.append(f"{kind} {_otlp_endpoint(env, endpoint, protocol)}")
    return ", ".join(where)


def make_exporters(env: Mapping[str, str], endpoint: str = "") -> list[Any]:
    """The span exporters the variables (and the flag's `endpoint`) ask for."""
    exporters = []
    for name in _exporter_names(env):
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter(out=sys.stdout))  # stdout now, not at the SDK's import
        elif name == "otlp" and _protocol(env) == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter(endpoint=endpoint or None))  # None: the variables decide
        elif name == "otlp":
            from splitserve.runtime.otlp_http import OtlpHttpSpanExporter, parse_headers

            headers = env.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or env.get("OTEL_EXPORTER_OTLP_HEADERS", "")
            exporters.append(OtlpHttpSpanExporter(_otlp_endpoint(env, endpoint, "http"), parse_headers(headers)))
    return exporters


def init_tracing(service_name: str, instance: str, enabled: bool | None = None, endpoint: str = "") -> bool:
    """Set up the process's tracer; returns whether tracing is on. `endpoint`: --otlp-traces-endpoint."""
    global _tracer, _provider, _enabled
    _enabled = tracing_requested(os.environ, endpoint) if enabled is None else enabled
    if not _enabled:
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": service_name, "service.instance.id": instance})
    _provider = TracerProvider(resource=resource)
    for exporter in make_exporters(os.environ, endpoint):
        _provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(_provider)  # for libraries that trace through the global one
    _tracer = _provider.get_tracer("splitserve")  # ours, also when a provider was set before (tests)
    return True


def enabled() -> bool:
    return _enabled


def shutdown() -> None:
    """Flush pending spans (at process exit)."""
    if _enabled and _provider is not None:
        _provider.shutdown()


def trace_id_of(s) -> str:
    """The 32-hex trace id of span `s` ("" when off or a no-op span)."""
    if s is _NOOP or s is None:
        return ""
    return f"{s.get_span_context().trace_id:032x}"


def extract(carrier: Mapping[str, str] | None) -> Any:
    """An OpenTelemetry context from a traceparent carrier (None when off or absent)."""
    if not _enabled or not carrier:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier=dict(carrier))


def metadata_carrier(metadata) -> dict[str, str]:
    """traceparent/tracestate from gRPC invocation metadata."""
    if not _enabled or metadata is None:
        return {}
    return {k: v for k, v in metadata if k in ("traceparent", "tracestate")}


def inject(span_or_context=None) -> dict[str, str]:
    """A traceparent carrier for the current (or given) span; {} when off."""
    if not _enabled:
        return {}
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    context = (
        trace.set_span_in_context(span_or_context)
        if span_or_context is not None and not isinstance(span_or_context, dict)
        else None
    )
    TraceContextTextMapPropagator().inject(carrier, context=context)
    return carrier


@contextmanager
def span(name: str, parent=None, attributes: dict | None = None, kind: str = "internal") -> Iterator[Any]:
    """A span for the duration of the block (a no-op object when tracing is off)."""
    if not _enabled:
        yield _NOOP
        return
    from opentelemetry import trace

    kinds = {"internal": trace.SpanKind.INTERNAL, "server": trace.SpanKind.SERVER, "client": trace.SpanKind.CLIENT}
    with _tracer.start_as_current_span(name, context=parent, kind=kinds[kind], attributes=attributes or {}) as s:
        yield s


def record_span(name: str, start_ns: int, end_ns: int, parent_span=None, attributes: dict | None = None) -> None:
    """A finished span with known wall-clock times (time.time_ns()), child of parent_span."""
    if not _enabled or end_ns <= 0:
        return
    from opentelemetry import trace

    context = trace.set_span_in_context(parent_span) if parent_span is not None else None
    s = _tracer.start_span(name, context=context, start_time=start_ns, attributes=attributes or {})
    s.end(end_time=max(end_ns, start_ns))


class _Noop:
    def set_attribute(self, *_a, **_k) -> None:
        pass

    def set_attributes(self, *_a, **_k) -> None:
        pass

    def record_exception(self, *_a, **_k) -> None:
        pass

    def set_status(self, *_a, **_k) -> None:
        pass


_NOOP = _Noop()


def start_span(name: str, parent=None, attributes: dict | None = None, kind: str = "server"):
    """A span that outlives a block (end it with end_span); _NOOP when off."""
    if not _enabled:
        return _NOOP
    from opentelemetry import trace

    kinds = {"internal": trace.SpanKind.INTERNAL, "server": trace.SpanKind.SERVER, "client": trace.SpanKind.CLIENT}
    return _tracer.start_span(name, context=parent, kind=kinds[kind], attributes=attributes or {})


def context_of(s):
    """An OpenTelemetry context whose current span is `s` (None when off)."""
    if s is _NOOP or s is None:
        return None
    from opentelemetry import trace

    return trace.set_span_in_context(s)


def end_span(s, error: str | None = None) -> None:
    if s is _NOOP or s is None:
        return
    if error:
        from opentelemetry.trace import Status, StatusCode

        s.set_status(Status(StatusCode.ERROR, error))
    s.end()
