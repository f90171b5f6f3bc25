"""Frozen configs of the gateway (`splitserve gateway`) and of `splitserve up`."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from splitserve.common.config_fields import internal_token_option, option
from splitserve.common.sampling_params import MAX_STOP_STRINGS
from splitserve.gateway.tool_parsers import TOOL_PARSERS

# engine.kv_connectors.factory.TRANSPORTS, repeated here so the gateway never imports torch
# (tests/cli/test_supervisor.py checks that the two agree).
KV_TRANSPORTS = ("shm", "cuda_ipc", "nccl", "nixl")


def split_addresses(value: str) -> tuple[str, ...]:
    """'a:1, b:2' -> ('a:1', 'b:2'); empty entries and repeats dropped, order kept."""
    out: list[str] = []
    for part in value.split(","):
        part = part.strip()
        if part and part not in out:
            out.append(part)
    return tuple(out)


@dataclass(frozen=True)
class GatewayConfig:
    """Where the gateway listens, which instances it routes to, its admission limits, auth and rate limits.

    Rate limits are per API key; without configured keys every caller shares one bucket.
    API keys themselves are never config fields (the config is printed at start).
    """

    host: str = option("127.0.0.1", "address to bind the gRPC and REST servers")
    grpc_port: int = option(50051, "gRPC port of the Generation API; 0 = any free port", min=0, max=65535)
    http_port: int = option(8000, "REST (OpenAI-compatible) port; 0 = no REST", min=0, max=65535)
    model: str = option(
        "",
        "model directory or Hugging Face id (through the hub cache) whose tokenizer the gateway uses; "
        "empty = the embedded default model",
    )
    revision: str = option("", "branch, tag or commit of a Hugging Face id; empty = main; ignored for a directory")
    model_id: str = option("", "model id served; empty = the instances' Describe model_id")
    served_model_name: str = option(
        "", "names clients may give the model, comma-separated, as vLLM's --served-model-name; empty = the model id"
    )
    prefill: str = option(
        "",
        "prefill instances, comma-separated: host:port, or dns:///host:port for every address the name resolves "
        "to (a headless Service's pods), re-resolved every --discovery-interval-s",
    )
    decode: str = option(
        "",
        "decode instances (or colocated workers, role both), comma-separated: host:port, or dns:///host:port for "
        "every address the name resolves to, re-resolved every --discovery-interval-s",
    )
    discovery_interval_s: float = option(
        5.0,
        "seconds between lookups of the dns:/// names of --prefill and --decode: a new address is routed to once "
        "its Describe answers, one no longer listed gets no new requests and its running ones finish; a failed "
        "lookup keeps the last answer",
        min=0.01,
        max=3600.0,
    )
    health_interval_s: float = option(0.5, "seconds between Describe calls to every instance", min=0.01, max=3600.0)
    health_timeout_s: float = option(
        0.0,
        "how long one Describe may take; a later answer is logged and ignored, never marks the instance down "
        "(a busy instance answers late); 0 = max(2, 4 x health_interval_s)",
        min=0.0,
        max=3600.0,
    )
    health_ping_timeout_s: float = option(
        10.0,
        "an instance whose health connection leaves an HTTP/2 ping unanswered this long is marked down (a "
        "stopped or wedged process; a busy one still answers pings, from gRPC's own threads)",
        min=0.5,
        max=3600.0,
    )
    request_timeout_s: float = option(600.0, "longest a request may run end to end", min=0.01, max=86400.0)
    max_connections: int = option(
        4096,
        "most open REST connections; more are answered 503 and closed (uvicorn's limit_concurrency; with "
        "--api-server-count N each process takes max_connections // N)",
        min=1,
        max=1 << 20,
    )
    http_header_timeout_s: float = option(
        10.0, "a REST connection that has not sent a whole request head by then is closed", min=0.1, max=3600.0
    )
    http_keep_alive_s: float = option(
        5.0,
        "an idle keep-alive REST connection is closed after this long (vLLM's default), cleanly: a request the "
        "client sent on it meanwhile meets a closed connection with no answer, which httpx clients (the OpenAI "
        "SDK) send again but aiohttp does not for a POST; above the client's own idle limit (vllm bench "
        "serve's is 60 s) the client closes first and no request meets it",
        min=0.1,
        max=3600.0,
    )
    max_body_bytes: int = option(
        1 << 20,
        "largest REST request body (HTTP 413) and gRPC request message (RESOURCE_EXHAUSTED)",
        min=1024,
        max=1 << 30,
    )
    max_stop_strings: int = option(MAX_STOP_STRINGS, "most stop strings per request", min=0, max=MAX_STOP_STRINGS)
    max_answer_entries: int = option(
        1 << 20,
        "most token entries a request's answer may hold at worst: prompts x sequences x (max_tokens + prompt "
        "tokens with prompt_logprobs or echo) x (1 + logprobs); more is refused (400) before any work",
        min=1024,
        max=1 << 30,
    )
    max_request_tokens: int = option(
        1 << 17,
        "most tokens one request may ask the engines for: the sum over its prompts of sequences x min(prompt "
        "tokens + max_tokens, context), a text prompt counted as its UTF-8 bytes; more is refused (400) before "
        "any work. Never below the context length, so one sequence of any allowed size always passes",
        min=1,
        max=1 << 40,
    )
    max_concurrent_requests: int = option(
        1024, "requests in flight before answering RESOURCE_EXHAUSTED / HTTP 503", min=1, max=1 << 20
    )
    stream_interval: int = option(
        1,
        "tokens a stream's message carries at least after its first (vLLM's --stream-interval): 1 sends every step's "
        "token at once; more sends fewer, larger messages (less gateway work a token, coarser streaming); a stream "
        "that falls behind gets its queued tokens in one message either way",
        min=1,
        max=1024,
    )
    api_server_count: int = option(
        1,
        "gateway processes sharing the REST and gRPC ports (vLLM's --api-server-count; SO_REUSEPORT): each "
        "runs the request path on its own core; admission, rate limits and /metrics stay gateway-wide",
        min=1,
        max=64,
    )
    drain_grace_s: float = option(30.0, "on SIGTERM: how long in-flight requests may finish", min=0.0, max=3600.0)
    max_waiting_per_decode: int = option(
        256,
        "requests waiting at one decode (its Describe num_waiting plus those sent "
        "since and not running yet) before it counts as full; all full = RESOURCE_EXHAUSTED / HTTP 503 (a request "
        "prefilled meanwhile still goes to one)",
        min=1,
        max=1 << 20,
    )
    otlp_traces_endpoint: str = option(
        "",
        "send traces to this OTLP collector (vLLM's flag; grpc, or http/protobuf with OTEL_EXPORTER_OTLP_PROTOCOL); "
        "empty = as the OTEL_* variables say (off when none is set)",
    )
    enable_log_requests: bool = option(
        True,
        "one log line per request (request id, trace id, route, status, tokens, TTFT, total ms, finish reason); "
        "--disable-log-requests (vLLM's flag) or --no-enable-log-requests turns it off",
        negated_by="--disable-log-requests",
    )
    metrics_port: int = option(
        0,
        "separate HTTP port for /metrics (for a gateway without REST; REST serves /metrics itself); 0 = off",
        min=0,
        max=65535,
    )
    chat_template: str = option(
        "",
        "chat template for every chat request instead of the model's: a file's path or the template itself "
        "(vLLM's --chat-template); empty = the model's",
    )
    api_keys_file: str = option(
        "",
        "file of API keys, one per line (# comments); with it or SPLITSERVE_API_KEYS "
        "(comma-separated) every public call needs 'Authorization: Bearer <key>'",
    )
    internal_tls_cert: str = option("", "PEM client certificate for mTLS to prefill/decode (with key and CA)")
    internal_tls_key: str = option("", "PEM private key for internal mTLS")
    internal_tls_ca: str = option("", "PEM CA that signs the internal services' certificates")
    internal_tls_server_name: str = option(
        "",
        "name the services' certificates are checked against, whatever address is dialed (health servers are "
        "advertised by IP); empty = the dialed host",
    )
    internal_token: str = internal_token_option()
    tls_cert: str = option("", "PEM certificate for TLS on the public gRPC and REST ports (with --tls-key)")
    tls_key: str = option("", "PEM private key for TLS on the public ports (with --tls-cert)")
    rate_limit_rps: float = option(
        0.0, "requests per second per API key (token bucket); 0 = no limit", min=0.0, max=1e6
    )
    rate_limit_burst: int = option(
        0, "request bucket size per API key; 0 = max(1, ceil(rate_limit_rps))", min=0, max=1 << 20
    )
    rate_limit_tokens_per_min: int = option(
        0, "prompt tokens + max_tokens per minute per API key; 0 = no limit", min=0, max=1 << 40
    )
    enable_auto_tool_choice: bool = option(
        False, 'tool_choice "auto" on chat requests (as vLLM: needs --tool-call-parser); off = such requests get 400'
    )
    tool_call_parser: str = option(
        "", "how the model writes tool calls (vLLM's parser names)", choices=("", *sorted(TOOL_PARSERS))
    )

    def __post_init__(self) -> None:
        from splitserve.gateway.discovery import parse_pool

        parse_pool("prefill", self.prefill_addresses)  # ConfigError naming the flag and the entry
        parse_pool("decode", self.decode_addresses)

    @property
    def prefill_addresses(self) -> tuple[str, ...]:
        return split_addresses(self.prefill)

    @property
    def decode_addresses(self) -> tuple[str, ...]:
        return split_addresses(self.decode)


@dataclass(frozen=True)
class UpConfig:
    """Ports and shape of the loopback stack that `splitserve up` starts."""

    prefill_port: int = option(
        50061, "gRPC port of prefill instance 0 (instance i uses prefill_port + i)", min=1, max=65535
    )
    decode_port: int = option(
        50071, "gRPC port of decode instance 0 (instance i uses decode_port + i)", min=1, max=65535
    )
    host: str = option(
        "127.0.0.1",
        "address the gateway's public ports (REST, gRPC) bind, e.g. 0.0.0.0 for every interface; the prefill and "
        "decodes stay on loopback",
    )
    grpc_port: int = option(50051, "gateway gRPC port", min=1, max=65535)
    http_port: int = option(8000, "gateway REST port (--port: vLLM's name)", min=1, max=65535, aliases=("--port",))
    kv_transport: str = option(
        "auto",
        "KV transport between prefill and decode; auto = what the placement supports (shm when the prefill runs "
        "on CPU, cuda_ipc when it runs on a GPU)",
        choices=("auto", *KV_TRANSPORTS),
    )
    num_prefill: int = option(1, "prefill instances, all given to the gateway", min=1, max=64)
    num_decode: int = option(1, "decode instances", min=1, max=64)
    metrics_ports: int = option(
        9100,
        "Prometheus /metrics of prefill i on port + i and of decode i on port + num_prefill + i (0 = off; the "
        "gateway's are on its REST port, or --metrics-port)",
        min=0,
        max=65535,
    )
    prefill_device: str = option(
        "", "device of the prefills (cpu, cuda:N); empty = placed from --device and the GPUs this machine has"
    )
    decode_device: str = option(
        "",
        "device of the decodes: one (for all) or one per decode, comma-separated; empty = placed from --device "
        "and the GPUs (one GPU: shared with the prefill; several: the prefill on cuda:0, decodes on the others)",
    )
    ready_timeout_s: float = option(300.0, "how long to wait for the stack to become ready", min=1.0, max=3600.0)
    stop_grace_s: float = option(
        45.0,
        "on Ctrl-C / SIGTERM: how long each stage of the drain (the gateway, then prefill and decodes) may take "
        "before its processes are killed; above the services' drain grace (30 s), so in-flight requests finish",
        min=0.0,
        max=3600.0,
    )
    max_restarts: int = option(
        3,
        "restarts of one child (one that exits by itself) within --restart-window-s; one more there stops the "
        "stack, reporting the child's last lines",
        min=0,
        max=1000,
    )
    restart_window_s: float = option(
        60.0, "the sliding window --max-restarts counts a child's restarts in", min=1.0, max=86400.0
    )
    restart_backoff_s: float = option(
        0.5,
        "wait before restarting a child; doubled for each of its restarts in the window (at most 30 s)",
        min=0.0,
        max=30.0,
    )


# GatewayConfig fields `splitserve up` sets itself (addresses, ports, model) or has no use for on
# loopback (internal mTLS); every other gateway option `up` takes and passes to its gateway.
UP_SETS_ITSELF = frozenset(
    {
        "host",
        "grpc_port",
        "http_port",
        "model",
        "revision",
        "model_id",
        "prefill",
        "decode",
        "discovery_interval_s",
        "internal_tls_cert",
        "internal_tls_key",
        "internal_tls_ca",
        "internal_tls_server_name",
        "internal_token",
    }
)


def _up_gateway_fields() -> list[tuple[str, type, dataclasses.Field]]:
    hints = typing.get_type_hints(GatewayConfig)
    return [
        (f.name, hints[f.name], dataclasses.field(default=f.default, metadata=f.metadata))
        for f in dataclasses.fields(GatewayConfig)
        if f.name not in UP_SETS_ITSELF
    ]


UpGatewayConfig = dataclasses.make_dataclass(
    "UpGatewayConfig",
    _up_gateway_fields(),
    frozen=True,
    namespace={
        "__doc__": "The gateway options of `splitserve up` (API keys, TLS, limits), passed to its gateway.",
        "__module__": __name__,
    },
)
