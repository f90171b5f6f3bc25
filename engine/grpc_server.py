"""Building a service's grpc.aio server (health, reflection) and draining it on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal

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


def insecure_channel(address: str) -> grpc.aio.Channel:
    """A grpc.aio channel to an internal peer, with fast reconnects."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def build_server(host: str, port: int, add_servicers, service_names: list[str]) -> tuple[grpc.aio.Server, health.HealthServicer, int]:
    """A grpc.aio server with our servicers, grpc.health.v1 and reflection; returns (server, health, port)."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", 0)])
    add_servicers(server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
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
