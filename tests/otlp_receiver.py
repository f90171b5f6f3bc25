"""A minimal OTLP/gRPC trace receiver (the collector's TraceService) that keeps every span, for tests."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[dict] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):
        self.keep(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def keep(self, request) -> None:
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"), ""
                )
                for scope in resource_spans.scope_spans:
                    for s in scope.spans:
                        self.spans.append(
                            {
                                "name": s.name,
                                "service": service,
                                "trace_id": s.trace_id.hex(),
                                "span_id": s.span_id.hex(),
                                "parent": s.parent_span_id.hex(),
                                "kind": s.kind,  # 1 internal, 2 server, 3 client
                                "attributes": {a.key: _value(a.value) for a in s.attributes},
                                "start": s.start_time_unix_nano,
                                "end": s.end_time_unix_nano,
                            }
                        )

    def stop(self) -> None:
        self.server.stop(0)


class HttpReceiver(Receiver):
    """The same over OTLP/HTTP (protobuf bodies POSTed to /v1/traces); `paths` lists the paths posted to."""

    def __init__(self) -> None:
        import http.server

        self.spans, self._lock, self.paths = [], threading.Lock(), []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.paths.append((self.path, self.headers["Content-Type"]))
                receiver.keep(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None
