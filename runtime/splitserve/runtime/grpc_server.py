"""Building a service's grpc.aio server (health, reflection) and draining it on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

log = logging.getLogger("splitserve.server")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


# gRPC C-core queues a call that the application has not picked up yet; over 1,000 queued calls it rejects
# new ones at random, over 3,000 all of them, and any call left there 30 s: the client sees a bare
# CANCELLED with no message, a call no handler (and no counter) ever saw. grpc.aio picks up one call per
# event-loop turn, so a burst outruns it (docs/performance.md, "Findings that set defaults": gRPC server options).
# With the queue this deep and no time limit of its own, every call reaches its handler, whose caps
# answer the excess with a named status (RESOURCE_EXHAUSTED and a message), or the caller's deadline
# ends it (DEADLINE_EXCEEDED).
MAX_PENDING_CALLS = 16384
SERVER_QUEUE_OPTIONS = [
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),  # soft limit: random rejections above it
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
    ("grpc.server_max_unrequested_time_in_server", 24 * 3600),  # seconds; the callers' deadlines are shorter
]

# Telling a busy instance from a hung one. A service whose event loop is swamped answers Describe late, but
# its gRPC core (threads of its own, no GIL) still answers HTTP/2 pings at once; a stopped or wedged
# process answers neither, and a dead one refuses or resets the connection. So the gateway's health
# connections ping every HEALTH_PING_INTERVAL_MS and count an unanswered ping (after the configured
# timeout) as a transport failure; a late Describe answer never marks an instance down.
HEALTH_PING_INTERVAL_MS = 1000


def health_channel_options(ping_timeout_s: float) -> tuple:
    """Options of a health connection: pings every HEALTH_PING_INTERVAL_MS, calls or not; the connection
    fails (UNAVAILABLE "ping timeout") when one stays unanswered `ping_timeout_s`. gRPC's own
    keepalive_timeout_ms is not what ends it: grpc.http2.ping_timeout_ms is (60 s by default)."""
    timeout_ms = int(ping_timeout_s * 1000)
    return (
        ("grpc.keepalive_time_ms", HEALTH_PING_INTERVAL_MS),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # no cap on pings between Describes
    )


# What a server needs to bear those pings: by default gRPC answers more than one ping in 5 minutes while
# it sends no data (a busy instance answering no Describe) with GOAWAY "too_many_pings", which would
# close the health connection exactly when the instance is only slow.
SERVER_PING_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", HEALTH_PING_INTERVAL_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),  # 0: never GOAWAY for pings
]

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # peers restart: retry connecting quickly instead of gRPC's default backoff of up to 2 minutes
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


# A channel with this option gets a connection of its own (gRPC otherwise shares one per target).
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


def insecure_channel(address: str, extra_options: tuple = ()) -> grpc.aio.Channel:
    """A grpc.aio channel to an internal peer, with fast reconnects."""
    return grpc.aio.insecure_channel(address, options=[*CHANNEL_OPTIONS, *extra_options])


@dataclass(frozen=True)
class InternalTls:
    """mTLS between internal services: every server asks for a client certificate signed by `ca`,
    every client presents `cert` and checks the server against `ca` (PEM files).

    `server_name`: the name every server's certificate is checked against, whatever address was dialed;
    empty = the dialed host. Peers dial each other by advertised addresses (pod IPs in Kubernetes, known
    only at run time), so deploy/ gives every certificate one shared name too (deploy/internal-certs.sh)
    and sets this to it: a server proves it holds a certificate of the internal CA."""

    cert: bytes
    key: bytes
    ca: bytes
    server_name: str = ""

    @classmethod
    def from_files(cls, cert: str, key: str, ca: str, server_name: str = "") -> InternalTls | None:
        """None when all three are empty; a ValueError naming the flags when only some are set, or the
        flag and the file when one cannot be read."""
        given = {"--internal-tls-cert": cert, "--internal-tls-key": key, "--internal-tls-ca": ca}
        if not any(given.values()):
            return None
        missing = [flag for flag, value in given.items() if not value]
        if missing:
            raise ValueError(
                f"internal mTLS needs all of --internal-tls-cert, --internal-tls-key and "
                f"--internal-tls-ca; missing {', '.join(missing)}"
            )
        pems = []
        for flag, path in given.items():
            try:
                pems.append(Path(path).read_bytes())
            except OSError as exc:
                raise ValueError(
                    f"{flag} {path!r} cannot be read ({exc.strerror}); deploy/internal-certs.sh makes a CA and "
                    "per-service certificates"
                ) from None
        return cls(*pems, server_name=server_name)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def channel_options(self, fallback_name: str = "") -> list[tuple[str, str]]:
        """Check the server's certificate against `server_name` (else `fallback_name`) instead of the dialed
        host."""
        name = self.server_name or fallback_name
        return [("grpc.ssl_target_name_override", name)] if name else []


TOKEN_KEY = "x-splitserve-internal-token"
# what answers without the token: probes (health) and tools (reflection)
_OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True)
class InternalAuth:
    """How internal services prove themselves to each other: mTLS (`tls`), a shared secret every call
    carries in metadata (`token`, from SPLITSERVE_INTERNAL_TOKEN), both, or neither."""

    tls: InternalTls | None = None
    token: str = ""

    @classmethod
    def from_config(cls, config) -> InternalAuth:
        """From a config with internal_tls_cert/key/ca/server_name and internal_token fields."""
        tls = InternalTls.from_files(
            config.internal_tls_cert, config.internal_tls_key, config.internal_tls_ca, config.internal_tls_server_name
        )
        return cls(tls, config.internal_token)


class _TokenCheck(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call without the shared secret (health and reflection stay open)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"internal call without a valid {TOKEN_KEY}")

        async def deny_stream(request_iterator, context):
            # let the client finish writing first (1 s at most): a status sent while it still writes reaches
            # it as a failed write ("Internal error from Core"), not as the refusal
            async def drain():
                async for _ in request_iterator:
                    pass

            with contextlib.suppress(Exception):
                await asyncio.wait_for(drain(), 1.0)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"internal call without a valid {TOKEN_KEY}")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_stream_rpc_method_handler(deny_stream)

    async def intercept_service(self, continuation, details):
        if details.method.startswith(_OPEN_SERVICES):
            return await continuation(details)
        sent = dict(details.invocation_metadata or ()).get(TOKEN_KEY, "")
        if hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, self._token):
            return await continuation(details)
        handler = await continuation(details)
        if handler is not None and handler.request_streaming:
            return self._deny_stream
        return self._deny


class _WithToken:
    """Adds the shared secret to a call's metadata. grpc.aio files each interceptor under one call kind
    only, so each kind gets its own object (`_token_interceptors`)."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def _call(self, continuation, details, request):
        metadata = list(details.metadata or ()) + [(TOKEN_KEY, self._token)]
        return await continuation(details._replace(metadata=metadata), request)


class _UnaryUnaryToken(_WithToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await self._call(continuation, details, request)


class _UnaryStreamToken(_WithToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await self._call(continuation, details, request)


class _StreamUnaryToken(_WithToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await self._call(continuation, details, request_iterator)


class _StreamStreamToken(_WithToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await self._call(continuation, details, request_iterator)


def _token_interceptors(token: str) -> list:
    return [cls(token) for cls in (_UnaryUnaryToken, _UnaryStreamToken, _StreamUnaryToken, _StreamStreamToken)]


def internal_channel(
    address: str, auth: InternalAuth | None, extra_options: tuple = (), server_name: str = ""
) -> grpc.aio.Channel:
    """A channel to an internal peer: mTLS when configured, else plaintext (loopback/private network);
    every call carries the shared secret when one is set. With mTLS the peer's certificate is checked against
    --internal-tls-server-name when set, else `server_name` (the DNS name a pool member was found under while
    it is dialed by IP), else the dialed host."""
    auth = auth or InternalAuth()
    options = [*CHANNEL_OPTIONS, *extra_options]
    interceptors = _token_interceptors(auth.token) if auth.token else None
    if auth.tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    options += auth.tls.channel_options(server_name)
    return grpc.aio.secure_channel(address, auth.tls.channel_credentials(), options=options, interceptors=interceptors)


class PortInUse(RuntimeError):
    """A server's address could not be bound (another process holds it, or the host is not this machine's)."""


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def enable_reflection(server: grpc.aio.Server, service_names: list[str]) -> None:
    """Server reflection of `service_names` under both of its names: grpc.reflection.v1 (what current grpcurl and
    grpc-requests ask first) and v1alpha (older clients). grpcio-reflection ships only v1alpha; the two
    protocols' messages are the same on the wire, so one servicer answers both."""
    from grpc_reflection.v1alpha import reflection_pb2

    servicer = reflection.aio.ReflectionServicer([*service_names, reflection.SERVICE_NAME, REFLECTION_V1])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    handlers = grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": v1})
    server.add_generic_rpc_handlers((handlers,))


def build_server(
    host: str, port: int, add_servicers, service_names: list[str], auth: InternalAuth | None = None
) -> tuple[grpc.aio.Server, health.HealthServicer, int]:
    """A grpc.aio server with our servicers, grpc.health.v1 and reflection; returns (server, health, port).
    With `auth`: mTLS and/or the shared secret on every call but health and reflection."""
    auth = auth or InternalAuth()
    tls = auth.tls
    server = grpc.aio.server(
        interceptors=[_TokenCheck(auth.token)] if auth.token else None,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            *SERVER_QUEUE_OPTIONS,
            *SERVER_PING_OPTIONS,
        ],
    )
    add_servicers(server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(server, [*service_names, health.SERVICE_NAME])
    address = f"{host}:{port}"
    try:  # grpcio raises (older ones returned 0) when another socket holds the address
        bound = server.add_secure_port(address, tls.server_credentials()) if tls else server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise PortInUse(f"cannot listen on {address}: the address is in use or not available")
    return server, health_servicer, bound


def set_serving(health_servicer: health.HealthServicer, services: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *services]:
        health_servicer.set(name, status)


def install_drain(loop: asyncio.AbstractEventLoop, on_signal) -> asyncio.Event:
    """Call `on_signal()` once on SIGTERM/SIGINT; returns an event set at the first signal."""
    stopping = asyncio.Event()

    def handler(signum):
        if not stopping.is_set():
            log.info("received %s: draining", signal.Signals(signum).name)
            stopping.set()
            on_signal()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handler, sig)
    return stopping
