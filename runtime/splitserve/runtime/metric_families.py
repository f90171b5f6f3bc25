"""Every Prometheus family a splitserve process may export: its name, type, buckets and which roles own it.

Each fact has one exporter, so a dashboard or autoscaler that sums a family over every process counts it once:

    vllm:*                  engine facts, named, typed and bucketed as vLLM's PrometheusStatLogger exports them;
                            a request's facts are recorded by the engine that computed them (prompt facts where
                            the prompt ran, generation facts where the tokens were sampled, success where the
                            request ended), engine state by every engine for itself (label `instance`)
    splitserve:kv_*         the KV transfer between prefill and decode (no vLLM counterpart)
    splitserve:gateway_*    what clients saw at the gateway: latencies, tokens, outcomes, calls per route

Roles: "gateway", and the engine roles "prefill", "decode" and "both" (the colocated worker). A decode owns the
prompt facts as well (it prefills locally when no prefill serves), a prefill the end-of-request facts (a request
whose first token is its last ends there); only a decode samples a second token, so only it owns the per-token
latencies.
"""

from __future__ import annotations

from dataclasses import dataclass

ENGINE_ROLES = frozenset({"prefill", "decode", "both"})
ROLES = ENGINE_ROLES | {"gateway"}
FINISH_REASONS = ("stop", "length", "abort", "error")
POOLS = ("prefill", "decode")
POOL_MEMBER_STATES = ("up", "draining", "down")  # gateway/members.py MEMBER_STATES

# vLLM's buckets (vllm/v1/metrics/loggers.py), so its dashboards' quantiles read the same.
VLLM_TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_TOKEN_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
VLLM_REQUEST_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip
VLLM_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
VLLM_N_BUCKETS = (1, 2, 5, 10, 20)
# The gateway's own latencies keep finer low buckets: a GPU decode step is a few milliseconds.
GATEWAY_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0,
)  # fmt: skip
GATEWAY_TOKEN_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5,
)  # fmt: skip
TRANSFER_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
ZERO_ROUTES = (
    ("/v1/completions", "200"),
    ("/v1/chat/completions", "200"),
    ("/splitserve.v1.Generation/Generate", "OK"),
)
BY_MAX_MODEL_LEN = "1-2-5 up to max_model_len"  # vLLM's build_1_2_5_buckets(max_model_len)
# cache_config_info's labels besides model_name and instance: vLLM's CacheConfig field names, our values.
CACHE_INFO_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization", "num_gpu_blocks")


@dataclass(frozen=True)
class Family:
    """One exported family: `attr` is its `Metrics` attribute, `name` its full name (a counter's without
    `_total`, which prometheus_client appends), `owners` the roles that declare it."""

    attr: str
    name: str
    kind: str  # counter, gauge, histogram
    doc: str
    owners: frozenset[str]
    buckets: tuple | str = ()
    extra_labels: tuple[str, ...] = ()
    # how a gauge's values in several processes of one role (the gateway's --api-server-count) make one:
    # prometheus_client's multiprocess_mode; livesum for what each process holds (its requests), livemostrecent
    # for what each one sees of the same thing (the pools)
    across_processes: str = "livesum"

    def zero_label_sets(self) -> tuple[dict[str, str], ...]:
        """The label sets (besides model_name and instance) created at 0 when the process starts."""
        if not self.extra_labels:
            return ({},)
        if self.extra_labels == ("finished_reason",):
            return tuple({"finished_reason": r} for r in FINISH_REASONS)
        if self.extra_labels == ("route", "status"):  # the calls most clients make
            return tuple({"route": route, "status": status} for route, status in ZERO_ROUTES)
        if self.extra_labels == ("pool", "state"):
            return tuple({"pool": pool, "state": state} for pool in POOLS for state in POOL_MEMBER_STATES)
        return ()  # cache_config_info: set once, with its values


def _f(attr, name, kind, doc, owners, buckets=(), extra=(), across_processes="livesum") -> Family:
    return Family(attr, name, kind, doc, frozenset(owners), buckets, tuple(extra), across_processes)


_ENGINE, _DECODING, _GATEWAY = ENGINE_ROLES, {"decode", "both"}, {"gateway"}
_TRANSFER = {"prefill", "decode"}
FAMILIES = (
    # engine state, per engine
    _f("running", "vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", _ENGINE),
    _f("waiting", "vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", _ENGINE),
    _f("kv_usage", "vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", _ENGINE),
    _f("prefix_queries", "vllm:prefix_cache_queries", "counter", "Prefix cache queries, in tokens.", _ENGINE),
    _f("prefix_hits", "vllm:prefix_cache_hits", "counter", "Prefix cache hits, in tokens.", _ENGINE),
    _f("preemptions", "vllm:num_preemptions", "counter", "Cumulative number of preemptions.", _ENGINE),
    _f(
        "iteration_tokens",
        "vllm:iteration_tokens_total",
        "histogram",
        "Tokens computed per engine step.",
        _ENGINE,
        VLLM_ITERATION_TOKEN_BUCKETS,
    ),
    _f(
        "cache_info",
        "vllm:cache_config_info",
        "gauge",
        "Information of the KV cache config.",
        _ENGINE,
        (),
        CACHE_INFO_LABELS,
    ),
    # prompt facts: where the prompt was computed
    _f("prompt_tokens", "vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", _ENGINE),
    _f(
        "request_prompt_tokens",
        "vllm:request_prompt_tokens",
        "histogram",
        "Number of prefill tokens processed, per request.",
        _ENGINE,
        BY_MAX_MODEL_LEN,
    ),
    _f(
        "ttft",
        "vllm:time_to_first_token_seconds",
        "histogram",
        "Arrival at the engine to its first token.",
        _ENGINE,
        VLLM_TTFT_BUCKETS_S,
    ),
    _f(
        "queue",
        "vllm:request_queue_time_seconds",
        "histogram",
        "Time spent in WAITING phase for request.",
        _ENGINE,
        VLLM_REQUEST_BUCKETS_S,
    ),
    _f(
        "prefill_time",
        "vllm:request_prefill_time_seconds",
        "histogram",
        "Time spent in PREFILL phase for request.",
        _ENGINE,
        VLLM_REQUEST_BUCKETS_S,
    ),
    # generation and end-of-request facts: where the tokens were sampled, where the request ended
    _f("generation_tokens", "vllm:generation_tokens", "counter", "Number of generation tokens processed.", _ENGINE),
    _f(
        "request_generation_tokens",
        "vllm:request_generation_tokens",
        "histogram",
        "Number of generation tokens processed, per request.",
        _ENGINE,
        BY_MAX_MODEL_LEN,
    ),
    _f(
        "request_success",
        "vllm:request_success",
        "counter",
        "Count of processed requests by finish reason.",
        _ENGINE,
        (),
        ("finished_reason",),
    ),
    _f(
        "e2e",
        "vllm:e2e_request_latency_seconds",
        "histogram",
        "Arrival at the engine to finish.",
        _ENGINE,
        VLLM_REQUEST_BUCKETS_S,
    ),
    _f(
        "inference_time",
        "vllm:request_inference_time_seconds",
        "histogram",
        "Time spent in RUNNING phase for request.",
        _ENGINE,
        VLLM_REQUEST_BUCKETS_S,
    ),
    _f("params_n", "vllm:request_params_n", "histogram", "The n request parameter.", _ENGINE, VLLM_N_BUCKETS),
    _f(
        "params_max_tokens",
        "vllm:request_params_max_tokens",
        "histogram",
        "The max_tokens request parameter.",
        _ENGINE,
        BY_MAX_MODEL_LEN,
    ),
    # per-token latencies: only a decode samples a second token
    _f(
        "itl",
        "vllm:inter_token_latency_seconds",
        "histogram",
        "Time between consecutive output tokens.",
        _DECODING,
        VLLM_TOKEN_BUCKETS_S,
    ),
    _f(
        "tpot",
        "vllm:request_time_per_output_token_seconds",
        "histogram",
        "Mean time per output token after the first, per request.",
        _DECODING,
        VLLM_TOKEN_BUCKETS_S,
    ),
    _f(
        "decode_time",
        "vllm:request_decode_time_seconds",
        "histogram",
        "Time spent in DECODE phase for request.",
        _DECODING,
        VLLM_REQUEST_BUCKETS_S,
    ),
    # KV transfer
    _f("kv_transfer_bytes", "splitserve:kv_transfer_bytes", "counter", "KV bytes moved between instances.", _TRANSFER),
    _f(
        "kv_transfer_blocks",
        "splitserve:kv_transfer_blocks",
        "counter",
        "KV blocks moved between instances.",
        _TRANSFER,
    ),
    _f(
        "kv_transfer_time",
        "splitserve:kv_transfer_duration_seconds",
        "histogram",
        "Duration of one request's KV pull or send.",
        _TRANSFER,
        TRANSFER_BUCKETS_S,
    ),
    _f("kv_transfer_failures", "splitserve:kv_transfer_failures", "counter", "Failed KV pulls or sends.", _TRANSFER),
    _f(
        "kv_leases_expired", "splitserve:kv_leases_expired", "counter", "Prefill leases expired unclaimed.", {"prefill"}
    ),
    # the gateway: what clients saw
    _f(
        "gw_ttft",
        "splitserve:gateway_time_to_first_token_seconds",
        "histogram",
        "Arrival at the gateway to the first message with tokens.",
        _GATEWAY,
        GATEWAY_LATENCY_BUCKETS_S,
    ),
    _f(
        "gw_itl",
        "splitserve:gateway_inter_token_latency_seconds",
        "histogram",
        "Time between consecutive output tokens sent to the client.",
        _GATEWAY,
        GATEWAY_TOKEN_BUCKETS_S,
    ),
    _f(
        "gw_tpot",
        "splitserve:gateway_request_time_per_output_token_seconds",
        "histogram",
        "Mean time per output token after the first, per request, as sent to the client.",
        _GATEWAY,
        GATEWAY_TOKEN_BUCKETS_S,
    ),
    _f(
        "gw_e2e",
        "splitserve:gateway_e2e_request_latency_seconds",
        "histogram",
        "Arrival at the gateway to the request's end.",
        _GATEWAY,
        GATEWAY_LATENCY_BUCKETS_S,
    ),
    _f(
        "gw_prompt_tokens",
        "splitserve:gateway_prompt_tokens",
        "counter",
        "Prompt tokens of answered requests.",
        _GATEWAY,
    ),
    _f("gw_generation_tokens", "splitserve:gateway_generation_tokens", "counter", "Tokens sent to clients.", _GATEWAY),
    _f(
        "gw_request_success",
        "splitserve:gateway_request_success",
        "counter",
        "Answered requests by finish reason.",
        _GATEWAY,
        (),
        ("finished_reason",),
    ),
    _f(
        "gw_running", "splitserve:gateway_num_requests_running", "gauge", "Requests in flight at the gateway.", _GATEWAY
    ),
    _f(
        "gw_pool_members",
        "splitserve:gateway_pool_members",
        "gauge",
        "Members of the prefill and decode pools by state: up, draining, down.",
        _GATEWAY,
        (),
        ("pool", "state"),
        across_processes="livemostrecent",
    ),
    _f(
        "gw_requests",
        "splitserve:gateway_requests",
        "counter",
        "Calls by route and status code.",
        _GATEWAY,
        (),
        ("route", "status"),
    ),
)


def families_of(role: str) -> tuple[Family, ...]:
    """The families a process of `role` declares."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
    return tuple(f for f in FAMILIES if role in f.owners)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10
