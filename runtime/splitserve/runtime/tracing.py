"""OpenTelemetry tracing, off unless asked for, with no import of OpenTelemetry when off.

On: `SPLITSERVE_TRACING=1` (or the flag that sets it) or `OTEL_EXPORTER_OTLP_ENDPOINT` /
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` set. Spans go out over OTLP/gRPC (the standard OTEL_*
variables configure the exporter). Context crosses processes as W3C `traceparent`: in gRPC
metadata for unary calls, and in `DecodeRequest.trace_context` on the shared decode stream.

Spans whose times are known only afterwards (queueing, compute inside the engine core) are
recorded with explicit start/end times, so the hot path never waits on tracing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

_tracer = None
_enabled = False


def tracing_requested() -> bool:
    env = os.environ
    return env.get("SPLITSERVE_TRACING", "").lower() in ("1", "true", "yes", "on") or bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def init_tracing(service_name: str, instance: str, enabled: bool | None = None) -> bool:
    """Set up the process's tracer; returns whether tracing is on."""
    global _tracer, _enabled
    _enabled = tracing_requested() if enabled is None else enabled
    if not _enabled:
        return False
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": service_name, "service.instance.id": instance})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(), schedule_delay_millis=200))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("splitserve")
    return True


def enabled() -> bool:
    return _enabled


def shutdown() -> None:
    """Flush pending spans (at process exit)."""
    if _enabled:
        from opentelemetry import trace

        provider = trace.get_tracer_provider()
        if hasattr(provider, "shutdown"):
            provider.shutdown()


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
