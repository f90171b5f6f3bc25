"""What the prefill and decode services share: engine core process, identity, Describe,
draining. The services themselves never import each other."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import grpc

from splitserve.common.startup_heap import freeze_startup_heap
from splitserve.common.wire import layout_to_proto
from splitserve.engine.core_process.client import EngineClient
from splitserve.protos import common_pb2
from splitserve.runtime.grpc_server import InternalAuth, PortInUse, build_server, install_drain, set_serving
from splitserve.runtime.logs import setup_logging
from splitserve.runtime.metrics import ServiceCounters

log = logging.getLogger("splitserve.service")

# A running core sends something at least every HEARTBEAT_S (0.5 s) plus an idle wait (0.5 s), after each step, and
# from a thread of its own during a long step. A core silent for longer than SUSPECT_MIN_S, and than SUSPECT_STEPS
# times its longest recent step, is suspect (stopped, or stuck outside a step; not merely busy in a long one): a
# prefill takes no new request and hands back the ones waiting on it (UNAVAILABLE: the gateway retries them on
# another prefill, or on a decode), rather than holding them until --core-stall-timeout-s calls it hung.
SUSPECT_MIN_S = 1.75  # 0.75 s past the longest silence of a running core: a request waits under 2 s for a stopped one
SUSPECT_STEPS = 2.0
NUM_RECENT_STEPS = 64


class ServiceBase:
    """Owns the EngineClient and the bookkeeping both roles share."""

    role = "both"
    service_names: list[str] = []

    def __init__(self, engine_config, service_config) -> None:
        self.engine_config = engine_config
        self.config = service_config
        self.name = service_config.instance_name or f"{self.role}-{service_config.port}"
        self.start_unix_ns = time.time_ns()
        self.instance_id = f"{self.name}@{self.start_unix_ns}"
        self.counters = ServiceCounters()  # Describe's counters and Prometheus, one call per fact
        self.inflight = 0
        self.starting = True  # listening, preparing peers (before_serving): only ConfirmPair is answered
        self.draining = False
        self.core_stalled = ""  # why the engine core is taken as hung ("" while it answers)
        self.health_address = ""  # the Describe-only server's, once it listens
        self.internal_auth = InternalAuth.from_config(service_config)  # mTLS and/or the shared secret
        kv_options = {
            "transport": service_config.kv_transport,
            "instance": self.name,
            "start_epoch": self.start_unix_ns,
            "role": engine_config.role,
            "timeout_s": service_config.kv_transfer_timeout_s,
            "link_keepalive_ms": service_config.kv_link_keepalive_ms,
        }
        self.client = EngineClient(
            engine_config, kv_options, on_batch=self._core_message, process_init=setup_logging, on_death=self._core_died
        )
        self.exit_code = 0
        self._recent_step_s: deque[float] = deque(maxlen=NUM_RECENT_STEPS)  # the core's last steps, seconds
        self._stop: asyncio.Event | None = None  # set by SIGTERM/SIGINT, or when the core dies
        self.metrics = None  # built once the core reports the model id

    def _core_message(self, msg) -> None:
        from splitserve.engine.core_process.messages import StepBatch

        if isinstance(msg, StepBatch) and msg.step_ns:
            self._recent_step_s.append(msg.step_ns / 1e9)
        if isinstance(msg, StepBatch) and self.metrics is not None:
            self.metrics.observe_engine_stats(msg.stats)
            self.metrics.observe_step(msg.num_tokens)
        self.on_core_message(msg)

    def on_core_message(self, msg) -> None:  # overridden by roles that need core messages
        pass

    def _core_died(self, why: str) -> None:
        """The engine core is gone: nothing this process holds can finish. Fail the in-flight requests,
        report NOT_SERVING (Describe answers UNAVAILABLE), and exit 1 so that compose, Kubernetes or
        `splitserve up` restarts the service."""
        log.error("%s: %s; failing in-flight requests and exiting", self.name, why)
        self.on_core_death(why)
        self.exit_code = 1
        if self._stop is not None:
            self._stop.set()

    def on_core_death(self, why: str) -> None:  # overridden by roles that track requests themselves
        pass

    async def _watch_core(self, healths) -> None:
        """Take the core as hung once it has been silent, or in one step, for --core-stall-timeout-s (a running
        core steps or sends a heartbeat every second, during a long step too): health NOT_SERVING, Describe and
        new requests UNAVAILABLE, so the gateway routes around this instance; serving again once the core
        answers."""
        while not self.client.dead:
            await asyncio.sleep(0.25)
            quiet_s, in_step_s = self.client.silent_s(), self.client.in_step_s()
            silent_s = max(quiet_s, in_step_s)
            if not self.core_stalled and silent_s > self.config.core_stall_timeout_s:
                self.core_stalled = (
                    f"{self.name}: its engine core has not answered for {quiet_s:.0f} s"
                    if quiet_s >= in_step_s
                    else f"{self.name}: its engine core has been in one step for {in_step_s:.0f} s"
                )
                log.error("%s; not ready until it does", self.core_stalled)
                for h in healths:
                    set_serving(h, self.service_names, False)
                self.on_core_stall(self.core_stalled)
            elif self.core_stalled and silent_s < self.config.core_stall_timeout_s:
                log.warning(
                    "%s: its engine core answers again after %s", self.name, self.core_stalled.split(" for ")[1]
                )
                self.core_stalled = ""
                if not self.draining:
                    for h in healths:
                        set_serving(h, self.service_names, True)

    def on_core_stall(self, why: str) -> None:  # overridden by roles that fail their in-flight requests then
        pass

    def core_suspect(self) -> str | None:
        """Why the engine core is suspect of hanging (silent past SUSPECT_MIN_S and SUSPECT_STEPS of its longest
        recent step, short of --core-stall-timeout-s), or None while it answers in time."""
        silent_s = self.client.silent_s()
        longest_step_s = max(self._recent_step_s, default=0.0)
        bound_s = min(max(SUSPECT_MIN_S, SUSPECT_STEPS * longest_step_s), self.config.core_stall_timeout_s)
        if silent_s <= bound_s:
            return None
        return (
            f"{self.name}: its engine core has been silent for {silent_s:.1f} s (its recent steps took at most "
            f"{longest_step_s:.2f} s), as if hung; try another instance"
        )

    def check_accepting(self, context) -> None:
        """Refuse new work while draining or over the queue bound (raises via context.abort)."""
        if self.client.dead:
            raise _Refuse(grpc.StatusCode.UNAVAILABLE, f"{self.name}: the engine core process exited")
        if self.starting:
            raise _Refuse(grpc.StatusCode.UNAVAILABLE, f"{self.name} is starting (preparing its peers)")
        if self.core_stalled:
            raise _Refuse(grpc.StatusCode.UNAVAILABLE, self.core_stalled)
        if why := self.core_suspect():
            raise _Refuse(grpc.StatusCode.UNAVAILABLE, why)
        if self.draining:
            raise _Refuse(grpc.StatusCode.UNAVAILABLE, f"{self.name} is draining")
        if self.inflight >= self.config.max_queued_requests:
            raise _Refuse(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.name} has {self.inflight} requests in flight "
                f"(max_queued_requests={self.config.max_queued_requests})",
            )

    def load(self) -> common_pb2.Load:
        s = self.client.stats
        return common_pb2.Load(
            num_free_blocks=s.get("num_free_blocks", 0),
            num_total_blocks=s.get("num_total_blocks", 0),
            num_running=s.get("num_running", 0),
            num_waiting=s.get("num_waiting", 0),
            num_queued_tokens=s.get("num_queued_tokens", 0),
            num_leases=s.get("num_held", 0),
        )

    async def Describe(self, request, context) -> common_pb2.DescribeResponse:
        if self.client.dead:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}: the engine core process exited")
        if self.starting:  # not ready to be registered: a gateway routes nothing here yet
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} is starting (preparing its peers)")
        if self.core_stalled:  # hung: the gateway marks this instance down until it answers again
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.core_stalled)
        # The core reports its stats with every step (and after aborts/releases), so the last
        # snapshot is current; a round trip to a busy core would make health checks time out.
        stats = self.client.stats
        if not stats and not self.client.dead:
            stats = self.client.stats = await self.client.query("stats")
        counters = {k: int(v) for k, v in {**stats, **self.counters.values}.items()}
        return common_pb2.DescribeResponse(
            instance_id=self.instance_id,
            role=self.engine_config.role if self.role != "prefill" else "prefill",
            model_id=self.client.info.model_id,
            layout=layout_to_proto(self.client.layout),
            load=self.load(),
            transports=[self.config.kv_transport],
            kv_endpoint=self.client.endpoint,
            start_unix_ns=self.start_unix_ns,
            max_model_len=self.client.info.max_model_len,
            counters=counters,
            draining=self.draining,
            health_address=self.health_address,
        )

    def _add_describe(self, server) -> None:
        """The health server's one method: this service's Describe."""
        method = grpc.unary_unary_rpc_method_handler(
            self.Describe,
            request_deserializer=common_pb2.DescribeRequest.FromString,
            response_serializer=common_pb2.DescribeResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(self.service_names[0], {"Describe": method}),)
        )

    async def serve(self, add_servicers) -> int:
        """Start the core and the gRPC server; run until SIGTERM, then drain. A start that fails after the core
        runs (a port in use, a peer refused) stops the core before raising: the process then exits instead of
        waiting on the core it started."""
        await self.client.start()
        try:
            return await self._serve(add_servicers)
        except BaseException:
            self.client.shutdown()
            raise

    async def _serve(self, add_servicers) -> int:
        from splitserve.runtime.metrics import Metrics, model_label, serve_http

        info, config = self.client.info, self.engine_config
        cache_info = {
            "block_size": config.block_size,
            "cache_dtype": config.kv_cache_dtype,
            "enable_prefix_caching": config.enable_prefix_caching,
            "gpu_memory_utilization": config.kv_cache_memory_fraction,
            "num_gpu_blocks": info.num_kv_blocks,
        }
        self.metrics = Metrics(
            model_label(self.config.served_model_name, info.model_id),
            self.name,
            self.role,
            info.max_model_len,
            cache_info,
        )
        self.counters.attach(self.metrics)
        if self.config.metrics_port:
            bound = serve_http(self.metrics.registry, self.config.host, self.config.metrics_port).server_address[1]
            log.info("%s metrics on http://%s:%d/metrics", self.name, self.config.host, bound)
        try:
            server, health, port = build_server(
                self.config.host, self.config.port, add_servicers, self.service_names, self.internal_auth
            )
        except PortInUse as exc:
            raise PortInUse(f"{self.name} --port {self.config.port}: {exc}") from None
        # gRPC hands a server's calls to it in arrival order: behind a burst of queued requests a Describe
        # waited long enough for the gateway to mark a busy instance down (docs/performance.md, "Findings that
        # set defaults"). A second server answers only Describe and health; Describe advertises it.
        try:
            health_server, health_health, health_port = build_server(
                self.config.host, self.config.health_port, self._add_describe, self.service_names, self.internal_auth
            )
        except PortInUse as exc:
            raise PortInUse(f"{self.name} --health-port {self.config.health_port}: {exc}") from None
        self.health_address = f"{self.config.peer_host}:{health_port}"
        healths = (health, health_health)
        # Listen before preparing peers: a prefill with --decode-peers asks this decode to confirm the
        # pairing it starts there. Until ready, health says NOT_SERVING and Describe and requests are refused.
        for h in healths:
            set_serving(h, self.service_names, False)
        await server.start()
        await health_server.start()
        await self.before_serving()
        self.starting = False
        for h in healths:
            set_serving(h, self.service_names, True)
        await self.on_started()
        log.debug("start-up heap frozen: %d objects out of the collector's passes", freeze_startup_heap())
        log.info(
            "%s serving on %s:%d (model=%s, blocks=%d, transport=%s)",
            self.instance_id,
            self.config.host,
            port,
            self.client.info.model_id,
            self.client.info.num_kv_blocks,
            self.config.kv_transport,
        )
        print(f"READY {self.role} {self.config.host}:{port}", flush=True)

        def begin_drain():
            self.draining = True
            for h in healths:
                set_serving(h, self.service_names, False)

        self._stop = install_drain(asyncio.get_running_loop(), begin_drain)
        watchdog = asyncio.create_task(self._watch_core(healths))
        if self.client.dead:  # died before the signal handlers were in place
            self._stop.set()
        await self._stop.wait()
        self.draining = True
        for h in healths:
            set_serving(h, self.service_names, False)
        deadline = time.monotonic() + self.config.drain_grace_s
        while self.inflight > 0 and not self.client.dead and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        watchdog.cancel()
        await self.on_stopping()
        await server.stop(1.0)
        await health_server.stop(0)
        self.client.shutdown()
        log.info("%s stopped (%d requests still in flight at exit)", self.instance_id, self.inflight)
        return self.exit_code

    async def before_serving(self) -> None:  # the core runs; the server listens but serves no request yet
        pass

    async def on_started(self) -> None:
        pass

    async def on_stopping(self) -> None:
        pass


class _Refuse(Exception):
    def __init__(self, code, message):
        super().__init__(message)
        self.code, self.message = code, message


Refuse = _Refuse
