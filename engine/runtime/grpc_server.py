"""Building a service's grpc.aio server (health, reflection) and draining it on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger("splitserve.server")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


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
    every client presents `cert` and checks the server against `ca` (PEM files)."""

    cert: bytes
    key: bytes
    ca: bytes

    @classmethod
    def from_files(cls, cert: str, key: str, ca: str) -> InternalTls | None:
        """None when all three are empty; a ValueError naming the flags when only some are set."""
        given = {"--internal-tls-cert": cert, "--internal-tls-key": key, "--internal-tls-ca": ca}
        if not any(given.values()):
            return None
        missing = [flag for flag, value in given.items() if not value]
        if missing:
            raise ValueError(
                f"internal mTLS needs all of --internal-tls-cert, --internal-tls-key and "
                f"--internal-tls-ca; missing {', '.join(missing)}"
            )
        return cls(*(Path(value).read_bytes() for value in (cert, key, ca)))

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def internal_channel(address: str, tls: InternalTls | None, extra_options: tuple = ()) -> grpc.aio.Channel:
    """A channel to an internal peer: mTLS when configured, else plaintext (loopback/private network)."""
    if tls is None:
        return insecure_channel(address, extra_options)
    options = [*CHANNEL_OPTIONS, *extra_options]
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)


def build_server(
    host: str, port: int, add_servicers, service_names: list[str], tls: InternalTls | None = None
) -> tuple[grpc.aio.Server, health.HealthServicer, int]:
    """A grpc.aio server with our servicers, grpc.health.v1 and reflection; returns (server, health, port)."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ]
    )
    add_servicers(server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, tls.server_credentials()) if tls else server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"cannot bind gRPC port {host}:{port}")
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
