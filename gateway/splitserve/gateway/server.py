"""`splitserve gateway`: the gRPC Generation API and the REST shim in one asyncio loop.

SIGTERM / SIGINT drains: readiness and health turn NOT_SERVING, new requests are refused
(UNAVAILABLE / 503), in-flight requests may finish for up to drain_grace_s, then the
servers stop and the process exits 0. A second signal exits at once.

With --api-server-count N > 1 the command's process supervises N such gateway processes on the same
ports instead (gateway/processes.py); `GatewayServer` then runs with their shared counts and metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import ssl
import sys
import time
from collections.abc import Mapping
from typing import Any

import grpc

from splitserve.common.startup_heap import freeze_startup_heap
from splitserve.gateway.admission import LocalCounts
from splitserve.gateway.auth import ApiKeys, load_api_keys
from splitserve.gateway.config import GatewayConfig
from splitserve.gateway.discovery import Resolver
from splitserve.gateway.grpc_api import HealthReporter, add_services
from splitserve.gateway.limits import RateLimiter
from splitserve.gateway.observe import GatewayMetrics
from splitserve.gateway.processes import ProcessShare, Supervisor, follow_parent, reuseport_listener
from splitserve.gateway.registry import Registry
from splitserve.gateway.request_log import RequestLog
from splitserve.gateway.rest_server import embedded_uvicorn
from splitserve.gateway.rest_tools import ToolSettings
from splitserve.gateway.router import Router
from splitserve.gateway.service import GatewayService

log = logging.getLogger("splitserve.gateway")
MAX_SEND_BYTES = 64 << 20  # answers (token ids, logprobs) may exceed what a request may carry


def load_gateway_tokenizer(model: str) -> Any:
    """The tokenizer of `model` (a directory), or of the embedded default model when empty."""
    from splitserve.common.tokenizer import load_tokenizer

    if not model:
        try:
            from splitserve.common.default_model_path import default_model_path
        except ImportError as exc:
            raise ValueError(
                f"no --model given and the embedded default model is not available ({exc}); "
                "pass --model with a model directory"
            ) from None
        model = str(default_model_path())
    if os.path.isfile(model):  # a config.json (load_format dummy): its directory holds the tokenizer
        model = os.path.dirname(model) or "."
    return load_tokenizer(model)


def read_chat_template(value: str) -> str | None:
    """--chat-template as vLLM reads it: a file's text, or the value itself when it is a template; None when
    unset. ValueError naming the flag when it is neither a readable file nor a template."""
    if not value:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {value!r} cannot be read: {exc}") from None
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value[:200]!r} is neither a file nor a jinja template ({{{{ or {{% in it)")


def load_tls(config: GatewayConfig) -> tuple[bytes, bytes] | None:
    """(certificate PEM, key PEM) for the public ports, or None; ValueError naming the flag."""
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ValueError(
            "--tls-cert and --tls-key must be given together (got only "
            f"{'--tls-cert' if config.tls_cert else '--tls-key'})"
        )
    if not config.tls_cert:
        return None
    pems = []
    for flag, path in (("--tls-cert", config.tls_cert), ("--tls-key", config.tls_key)):
        try:
            with open(path, "rb") as f:
                pems.append(f.read())
        except OSError as exc:
            raise ValueError(f"{flag} {path!r} cannot be read: {exc}") from None
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(config.tls_cert, config.tls_key)
    except ssl.SSLError as exc:
        raise ValueError(
            f"--tls-cert {config.tls_cert!r} and --tls-key {config.tls_key!r} are not a matching "
            f"PEM certificate and key: {exc}"
        ) from None
    return pems[0], pems[1]


class GatewayServer:
    """Owns the registry, router, service, metrics and the servers of one gateway process.

    `env` (default os.environ) is where SPLITSERVE_API_KEYS is read; `resolver` answers the dns:/// names of
    --prefill and --decode (default: the system's, getaddrinfo). `process`: this process's place among
    several of one gateway (--api-server-count, gateway/processes.py): the ports are shared, the admission
    counts and /metrics gateway-wide. `counts`: the admission counts to use (default: as `process` says).
    """

    def __init__(
        self,
        config: GatewayConfig,
        *,
        tokenizer: Any = None,
        http_socket: socket.socket | None = None,
        env: Mapping[str, str] | None = None,
        resolver: Resolver | None = None,
        process: ProcessShare | None = None,
        counts: LocalCounts | None = None,
    ) -> None:
        self.config = config
        self._resolver = resolver
        self._process = process
        self._counts = counts
        self._tokenizer = tokenizer
        self._http_socket = http_socket
        self._env = env
        self.grpc_port = 0
        self.http_port = 0
        self.metrics_port = 0
        self._grpc_server: grpc.aio.Server | None = None
        self._uvicorn: Any = None
        self._rest_task: asyncio.Task | None = None
        self._metrics_server: Any = None

    async def start(self) -> None:
        """Build everything, listen on the ports, then register instances (first Describe round)."""
        config = self.config
        tls = load_tls(config)
        self.tool_settings = ToolSettings(config.enable_auto_tool_choice, config.tool_call_parser)
        chat_template = read_chat_template(config.chat_template)  # refused before anything listens
        self.api_keys = ApiKeys(load_api_keys(config.api_keys_file, self._env))
        tokenizer = self._tokenizer if self._tokenizer is not None else load_gateway_tokenizer(config.model)
        from splitserve.runtime.grpc_server import InternalAuth, internal_channel

        internal_auth = InternalAuth.from_config(config)
        self.registry = Registry(
            config.prefill_addresses,
            config.decode_addresses,
            health_interval_s=config.health_interval_s,
            health_timeout_s=config.health_timeout_s,
            ping_timeout_s=config.health_ping_timeout_s,
            model_id=config.model_id,
            channel_factory=lambda address, extra, name: internal_channel(address, internal_auth, extra, name),
            discovery_interval_s=config.discovery_interval_s,
            resolver=self._resolver,
        )
        self.router = Router(self.registry, max_waiting_per_decode=config.max_waiting_per_decode)
        self._grpc_server, self.grpc_port = self._public_grpc_server(tls)
        self.metrics = self._gateway_metrics()
        counts = self._counts
        if counts is None:
            counts = self._process.open_counts() if self._process is not None else LocalCounts()
        limiter = RateLimiter(
            config.rate_limit_rps, config.rate_limit_burst, config.rate_limit_tokens_per_min, counts=counts
        )
        self.service = GatewayService(
            self.registry,
            self.router,
            tokenizer,
            max_concurrent_requests=config.max_concurrent_requests,
            max_stop_strings=config.max_stop_strings,
            max_answer_entries=config.max_answer_entries,
            max_request_tokens=config.max_request_tokens,
            request_timeout_s=config.request_timeout_s,
            limiter=limiter,
            metrics=self.metrics,
            served_model_names=[n.strip() for n in config.served_model_name.split(",") if n.strip()],
            stream_interval=config.stream_interval,
            chat_template=chat_template,
            counts=counts,
            processes_not_ready=self._process.processes_not_ready if self._process is not None else list,
        )
        self.health = HealthReporter()
        await self.health.set_ready(False)
        self.registry.listeners.append(lambda ready: self.service.spawn(self.health.set_ready(ready)))
        self.registry.listeners.append(self._learn_model)
        if self._process is not None:
            self.registry.listeners.append(self._process.mark_ready)
        self.registry.listeners.append(lambda ready: self.metrics.set_pool_members(self.registry.members.counts()))
        self.request_log = RequestLog(config.enable_log_requests)
        add_services(self._grpc_server, self.service, self.health, self.api_keys, self.metrics, self.request_log)
        # One process of several takes connections only once it has described the instances: a client that
        # another process already told "ready" must not land on one that refuses for not knowing them yet.
        # Alone, the gateway answers readiness probes (not ready) while it describes them.
        if self._process is not None:
            await self.registry.start()
        await self._listen()
        if self._process is None:
            await self.registry.start()
        log.info(
            "gateway up: gRPC %s:%d, REST %s, metrics port %s; TLS %s, API keys %d, rate limits %s; ready=%s",
            config.host,
            self.grpc_port,
            f"{'https' if tls else 'http'}://{config.host}:{self.http_port}" if self.http_port else "off",
            self.metrics_port or "off",
            "on" if tls else "off",
            self.api_keys.num_keys,
            f"{config.rate_limit_rps:g} rps, {config.rate_limit_tokens_per_min} tokens/min",
            self.registry.ready(),
        )

    async def _listen(self) -> None:
        """Serve the gRPC port, the REST port (this process's socket, when it is one of several) and, in one
        process only, the metrics port."""
        config = self.config
        await self._grpc_server.start()
        if self._process is not None and config.http_port and self._http_socket is None:
            self._http_socket = reuseport_listener(config.host, config.http_port)
        if config.http_port or self._http_socket is not None:
            await self._start_rest()
        if config.metrics_port and (self._process is None or self._process.index == 0):
            self._start_metrics_port()

    def _public_grpc_server(self, tls: tuple[bytes, bytes] | None) -> tuple[grpc.aio.Server, int]:
        """The Generation API's server, bound to its port (shared with the other gateway processes, if any)."""
        from splitserve.runtime.grpc_server import SERVER_QUEUE_OPTIONS

        config = self.config
        # the public API takes no message larger than a REST body: sizes are capped before tokenizing
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", config.max_body_bytes),
                ("grpc.max_send_message_length", MAX_SEND_BYTES),
                *SERVER_QUEUE_OPTIONS,  # a burst of streams reaches the handlers (and their named limits)
                *([("grpc.so_reuseport", 1)] if self._process is not None else []),  # the port's other processes
            ]
        )
        address = f"{config.host}:{config.grpc_port}"
        if tls:
            return server, server.add_secure_port(address, grpc.ssl_server_credentials([(tls[1], tls[0])]))
        return server, server.add_insecure_port(address)

    def _gateway_metrics(self) -> GatewayMetrics:
        """This process's metrics; /metrics shows every gateway process's, summed, when there are several."""
        from splitserve.runtime.metrics import Metrics, model_label, multiprocess_registry

        config = self.config
        # vLLM labels metrics with the first served name: a dashboard filters on the name clients send
        model_name = model_label(config.served_model_name, config.model_id)
        metrics = Metrics(model_name, f"gateway@{config.host}:{self.grpc_port}", "gateway")
        if self._process is None:
            return GatewayMetrics(metrics)
        return GatewayMetrics(metrics, multiprocess_registry(self._process.metrics_dir, metrics.labels))

    def _learn_model(self, ready: bool) -> None:
        if not (self.config.model_id or self.config.served_model_name) and self.registry.model_id:
            self.metrics.set_model(self.registry.model_id)

    def _start_metrics_port(self) -> None:
        from splitserve.runtime.metrics import serve_http

        try:
            self._metrics_server = serve_http(self.metrics.registry, self.config.host, self.config.metrics_port)
        except OSError as exc:
            raise OSError(
                f"--metrics-port {self.config.metrics_port} cannot be bound on {self.config.host}: {exc}"
            ) from None
        self.metrics_port = self._metrics_server.server_address[1]

    async def _start_rest(self) -> None:
        from splitserve.gateway.rest import create_app

        app = create_app(
            self.service,
            self.config.max_body_bytes,
            int(time.time()),
            api_keys=self.api_keys,
            metrics=self.metrics,
            tool_settings=self.tool_settings,
            request_log=self.request_log,
        )
        self._uvicorn = embedded_uvicorn(app, self.config, self.config.drain_grace_s)
        sockets = None
        if self._http_socket is not None:
            # asyncio sets TCP_NODELAY on accepted sockets only when the listener's proto is TCP;
            # a socket.socket() has proto 0, and Nagle + delayed ACKs then add ~40 ms to every
            # response. Accepted sockets inherit the listener's TCP_NODELAY.
            self._http_socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sockets = [self._http_socket]
        self._rest_task = asyncio.create_task(self._uvicorn.serve(sockets=sockets), name="gateway-rest")
        while not self._uvicorn.started and not self._rest_task.done():
            await asyncio.sleep(0.01)
        if self._rest_task.done():
            raise OSError(
                f"the REST server could not start on {self.config.host}:{self.config.http_port} (port in use?)"
            )
        if self._http_socket is not None:
            self.http_port = self._http_socket.getsockname()[1]
        else:
            self.http_port = self._uvicorn.servers[0].sockets[0].getsockname()[1]

    async def stop(self, grace_s: float) -> None:
        """Drain: refuse new requests (UNAVAILABLE / 503 naming the drain, while the servers still
        answer), let in-flight ones finish up to grace_s, then stop the servers."""
        self.service.draining = True
        await self.health.shutdown()
        await self.service.wait_idle(grace_s)
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        waits = []
        if self._grpc_server is not None:
            waits.append(self._grpc_server.stop(1.0))
        if self._rest_task is not None:
            waits.append(self._rest_task)
        await asyncio.gather(*waits, return_exceptions=True)
        if self._metrics_server is not None:
            await asyncio.to_thread(self._metrics_server.shutdown)
            self._metrics_server.server_close()
        await self.registry.close()


async def serve(config: GatewayConfig, process: ProcessShare | None = None) -> int:
    """Run until SIGTERM/SIGINT, then drain; 0 on a clean exit, 1 when start-up failed."""
    server = GatewayServer(config, process=process)
    try:
        await server.start()
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"splitserve gateway: error: {exc}", file=sys.stderr)
        return 1
    log.debug("start-up heap frozen: %d objects out of the collector's passes", freeze_startup_heap())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            log.warning("second %s: exiting without draining", signal.Signals(signum).name)
            os._exit(1)
        log.info("%s: draining (up to %g s)", signal.Signals(signum).name, config.drain_grace_s)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    await stop.wait()
    await server.stop(config.drain_grace_s)
    log.info("gateway stopped")
    return 0


def _checked(config: GatewayConfig) -> str:
    """What is wrong with the files the flags name (TLS, chat template, API keys), or "": checked once by the
    supervisor of several gateway processes, so a mistake is told once."""
    try:
        load_tls(config)
        read_chat_template(config.chat_template)
        load_api_keys(config.api_keys_file)
    except ValueError as exc:
        return str(exc)
    return ""


def run_process(config: GatewayConfig, process: ProcessShare) -> None:
    """One of several gateway processes (gateway/processes.py): the gateway on the shared ports until drained."""
    follow_parent(process)
    sys.exit(_run(config, process))


def _run(config: GatewayConfig, process: ProcessShare | None) -> int:
    from splitserve.runtime import tracing
    from splitserve.runtime.logs import setup_logging

    setup_logging()
    instance = f"gateway@{config.host}:{config.grpc_port}" + (f"/{process.index}" if process is not None else "")
    tracing.init_tracing("splitserve-gateway", instance, endpoint=config.otlp_traces_endpoint)
    log.info("traces: %s", tracing.destination(endpoint=config.otlp_traces_endpoint))
    try:
        return asyncio.run(serve(config, process))
    finally:
        tracing.shutdown()


def run(ns: Any, configs: dict[str, Any]) -> int:
    """Entry point of `splitserve gateway` (see splitserve.cli): one gateway process, or with
    --api-server-count N a supervisor of N (gateway/processes.py)."""
    config = configs["GatewayConfig"]
    if config.api_server_count == 1:
        return _run(config, None)
    from splitserve.runtime.logs import setup_logging

    setup_logging()
    problem = _checked(config)
    if problem:
        print(f"splitserve gateway: error: {problem}", file=sys.stderr)
        return 1
    return Supervisor(config, run_process).run()
