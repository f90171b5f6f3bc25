"""Config of a prefill, decode or colocated-worker service process (besides EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.config_fields import ConfigError, internal_token_option, option, validate_fields
from splitserve.common.nixl_package import nixl_missing
from splitserve.engine.kv_connectors.factory import TRANSPORTS
from splitserve.engine.kv_connectors.link_keepalive import MIN_PERIOD_MS


@dataclass(frozen=True)
class ServiceConfig:
    """Where a service listens and how it moves KV."""

    @property
    def peer_host(self) -> str:
        """The host peers should dial: --advertise-host, else --host (0.0.0.0 is no address to dial)."""
        return self.advertise_host or self.host

    host: str = option("127.0.0.1", "address to bind (internal services: loopback or the private network)")
    port: int = option(50061, "gRPC port", min=1, max=65535)
    advertise_host: str = option(
        "", "address peers use to reach this instance (KV handles, NCCL rendezvous); empty = --host"
    )
    metrics_port: int = option(0, "HTTP port for /metrics; 0 = off", min=0, max=65535)
    otlp_traces_endpoint: str = option(
        "",
        "send traces to this OTLP collector (vLLM's flag; grpc, or http/protobuf with OTEL_EXPORTER_OTLP_PROTOCOL); "
        "empty = as the OTEL_* variables say (off when none is set)",
    )
    health_port: int = option(
        0,
        "gRPC port of a second server answering only Describe and health (advertised in Describe, so the "
        "gateway's health checks never wait behind queued requests); 0 = any free port",
        min=0,
        max=65535,
    )
    instance_name: str = option("", "instance name; empty = <role>-<port>")
    served_model_name: str = option(
        "",
        "the model_name label of this instance's metrics: the first of these comma-separated names, as vLLM labels "
        "its metrics with the first --served-model-name; empty = the model id",
    )
    kv_transport: str = option(
        "shm",
        "KV transport: shm (CPU, same host), cuda_ipc (same-host GPUs), nccl (gloo on CPU), nixl (one-sided reads "
        "over UCX: RDMA across hosts; needs the splitserve-engine[nixl] extra)",
        choices=TRANSPORTS,
    )
    kv_transfer_timeout_s: float = option(10.0, "timeout of one KV transfer", min=0.1, max=600.0)
    lease_s: float = option(30.0, "prefill: how long an unclaimed KV handle stays valid", min=0.05, max=3600.0)
    kv_link_keepalive_ms: float = option(
        2.0,
        "decode on a GPU: every this many ms copy 1 MiB from each prefill GPU it "
        "pulls from (cuda_ipc: once its pool is mapped; nccl: once paired, the "
        "GPU its Describe names if this host has it), so the NVLink path is awake "
        "when a pull comes (an idle path costs a 256 MiB pull ~0.3 ms: "
        "docs/performance.md); nccl: costs a CUDA context (~0.3-0.5 GiB) on each such "
        "GPU; 0 = off, else >= 0.5",
        min=0.0,
        max=1000.0,
    )
    kv_load_failure_policy: str = option(
        "recompute", "decode: when a pull fails, prefill locally or fail the request", choices=("recompute", "fail")
    )
    prefill_peers: str = option(
        "",
        "decode: comma-separated prefill addresses to prepare at start (nccl: pair; shm, cuda_ipc: map the KV pool); "
        "when set, the only prefills whose KV handles it accepts",
    )
    decode_peers: str = option(
        "",
        "prefill: comma-separated decode addresses allowed to pair (nccl); when set, a PairKv is accepted only "
        "when one of them confirms it (ConfirmPair): a forged one never replaces a real pair's communicator",
    )
    max_queued_requests: int = option(
        1024, "requests a service accepts before answering RESOURCE_EXHAUSTED", min=1, max=1 << 20
    )
    drain_grace_s: float = option(30.0, "on SIGTERM: how long to let in-flight requests finish", min=0.0, max=3600.0)
    core_stall_timeout_s: float = option(
        10.0,
        "how long the engine core may stay silent (no step, no heartbeat) before the service takes it as hung: "
        "health NOT_SERVING, Describe and new requests UNAVAILABLE (the gateway routes around it), a prefill "
        "fails its in-flight requests; it serves again when the core answers",
        min=2.0,
        max=3600.0,
    )
    internal_tls_cert: str = option("", "PEM certificate for mTLS between internal services (with key and CA)")
    internal_tls_key: str = option("", "PEM private key for internal mTLS")
    internal_tls_ca: str = option("", "PEM CA that signs every internal service's certificate")
    internal_tls_server_name: str = option(
        "",
        "name the peers' certificates are checked against, whatever address is dialed (peers dial advertised "
        "addresses, e.g. pod IPs); empty = the dialed host",
    )
    internal_token: str = internal_token_option()

    def __post_init__(self) -> None:
        validate_fields(self)  # built directly too, not only from flags
        if 0 < self.kv_link_keepalive_ms < MIN_PERIOD_MS:
            raise ConfigError(
                f"--kv-link-keepalive-ms={self.kv_link_keepalive_ms} is out of range; "
                f"allowed 0 (off) or [{MIN_PERIOD_MS}, 1000.0]"
            )
        if self.kv_transport == "nixl" and (missing := nixl_missing()):
            raise ConfigError(missing)
