"""OTLP/HTTP with protobuf bodies (OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf): the spans as one
ExportTraceServiceRequest POSTed to the collector's /v1/traces, over the standard library's HTTP client.

Encoding is OpenTelemetry's own (`encode_spans`, already installed with the gRPC exporter), so a collector
reads what the gRPC exporter would have sent; only the transport is ours, which keeps the gateway's install
free of another exporter package.
"""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger("splitserve.tracing")


class OtlpHttpSpanExporter(SpanExporter):
    """POSTs each batch to `endpoint` (the full URL, .../v1/traces) with `headers`; a failed POST is logged
    and the batch dropped, as the SDK's exporters do after their retries."""

    def __init__(self, endpoint: str, headers: Mapping[str, str] | None = None, timeout_s: float = 10.0) -> None:
        self.endpoint = endpoint
        self.headers = {"Content-Type": "application/x-protobuf", **(headers or {})}
        self.timeout_s = timeout_s

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        body = encode_spans(spans).SerializeToString()
        request = urllib.request.Request(self.endpoint, data=body, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
        except (urllib.error.URLError, OSError) as exc:
            log.warning("OTLP/HTTP export of %d spans to %s failed: %s", len(spans), self.endpoint, exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def parse_headers(value: str) -> dict[str, str]:
    """OTEL_EXPORTER_OTLP_HEADERS: `key=value,key2=value2` (values URL-encoded, as the specification says)."""
    from urllib.parse import unquote

    headers = {}
    for item in value.split(","):
        if "=" in item:
            key, _, raw = item.partition("=")
            headers[key.strip()] = unquote(raw.strip())
    return headers
