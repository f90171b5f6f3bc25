"""Prometheus metrics of every splitserve process (names follow vLLM's, prefixed `splitserve:`).

The ones vLLM also exports (VLLM_NAMES) are exported a second time under vLLM's own `vllm:` prefix,
same labels and values (copied at scrape time), so dashboards, autoscalers and routers written for vLLM read
them unchanged.

Each process builds one `Metrics` on its own registry with constant labels model_name and
instance, and serves it on `/metrics` (gRPC-only processes on a separate HTTP port via
`serve_http`). Latency histograms are observed where the latency is known: TTFT, ITL, TPOT
and e2e at the gateway (what clients see) and at decode (per request it owns).
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TOKEN_LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
TRANSFER_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
# Metrics vLLM exports under the same name (after its `vllm:` prefix): exported under both prefixes.
VLLM_NAMES = frozenset(
    {
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "request_time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
    }
)


class _VllmAliases:
    """A collector that, at scrape time, repeats the VLLM_NAMES metrics under the `vllm:` prefix: the
    hot path updates one metric, the copy costs only the scrape."""

    def __init__(self) -> None:
        self.metrics: list = []

    def collect(self):
        for metric in self.metrics:
            for family in metric.collect():
                alias = Metric(family.name.replace("splitserve:", "vllm:", 1), family.documentation, family.type)
                alias.samples = [s._replace(name=s.name.replace("splitserve:", "vllm:", 1)) for s in family.samples]
                yield alias


class Metrics:
    """All metrics one process exports; unused ones simply stay at zero."""

    def __init__(self, model_name: str, instance: str, role: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "instance"]
        self.labels = {"model_name": model_name, "instance": instance}
        r, p = self.registry, "splitserve:"
        aliases = _VllmAliases()
        r.register(aliases)

        def alias(metric, name):
            if name in VLLM_NAMES:
                aliases.metrics.append(metric)
            return metric

        def hist(name, doc, buckets):
            return alias(Histogram(p + name, doc, labels, registry=r, buckets=buckets), name)

        def counter(name, doc, extra=()):
            return alias(Counter(p + name, doc, labels + list(extra), registry=r), name)

        def gauge(name, doc):
            return alias(Gauge(p + name, doc, labels, registry=r), name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS_S)
        self.itl = hist(
            "inter_token_latency_seconds", "Time between consecutive output tokens.", TOKEN_LATENCY_BUCKETS_S
        )
        self.tpot = hist(
            "request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            TOKEN_LATENCY_BUCKETS_S,
        )
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS_S)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled compute.", LATENCY_BUCKETS_S)
        self.prefill_time = hist("request_prefill_time_seconds", "Prompt compute time.", LATENCY_BUCKETS_S)
        self.decode_time = hist("request_decode_time_seconds", "First token to finish.", LATENCY_BUCKETS_S)
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
        self.request_success = counter("request_success_total", "Finished requests by reason.", ["finished_reason"])
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of KV blocks in use (0..1).")
        self.prefix_queries = counter("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions_total", "Requests preempted (recomputed later).")
        self.kv_transfer_bytes = counter("kv_transfer_bytes_total", "KV bytes moved between instances.")
        self.kv_transfer_blocks = counter("kv_transfer_blocks_total", "KV blocks moved between instances.")
        self.kv_transfer_time = hist(
            "kv_transfer_duration_seconds", "Duration of one request's KV pull or send.", TRANSFER_BUCKETS_S
        )
        self.kv_transfer_failures = counter("kv_transfer_failures_total", "Failed KV pulls or sends.")
        self.kv_leases_expired = counter("kv_leases_expired_total", "Prefill leases that expired unclaimed.")
        self.requests = counter("requests_total", "Requests by route and status code.", ["route", "status"])
        self._last_engine: dict[str, int] = {}
        self._children: dict[tuple, object] = {}

    def lab(self, metric, **extra):
        """The metric's child for this process's labels (plus `extra`), looked up once: prometheus_client's
        labels() costs microseconds, and the gateway asks for some per streamed token."""
        key = (id(metric), *self.labels.values(), *extra.items())  # the labels may change (the gateway's model)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self.labels, **extra)
        return child

    def observe_engine_stats(self, stats: dict[str, int]) -> None:
        """Update gauges and engine counters from a core StepBatch's stats snapshot."""
        if not stats:
            return
        self.lab(self.running).set(stats.get("num_running", 0))
        self.lab(self.waiting).set(stats.get("num_waiting", 0))
        total = stats.get("num_total_blocks", 0)
        if total:
            self.lab(self.kv_usage).set(1.0 - stats.get("num_free_blocks", 0) / total)
        for key, metric in (
            ("prefix_query_tokens", self.prefix_queries),
            ("prefix_hit_tokens", self.prefix_hits),
            ("num_preemptions", self.preemptions),
        ):
            delta = stats.get(key, 0) - self._last_engine.get(key, 0)
            if delta > 0:
                self.lab(metric).inc(delta)
            self._last_engine[key] = stats.get(key, 0)


# A Describe counter -> the Metrics attribute of the Prometheus counter that records the same fact.
PROMETHEUS_COUNTER_OF = {
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "kv_bytes_pulled": "kv_transfer_bytes",
    "kv_bytes_sent": "kv_transfer_bytes",
    "kv_blocks_pulled": "kv_transfer_blocks",
    "kv_blocks_sent": "kv_transfer_blocks",
    "kv_pull_failures": "kv_transfer_failures",
    "kv_send_failures": "kv_transfer_failures",
    "leases_expired": "kv_leases_expired",
}


class ServiceCounters:
    """The one sink of a service's event counts: `count(name, n)` adds to the counters Describe
    reports and, for a fact Prometheus exports too (PROMETHEUS_COUNTER_OF), to that counter, so
    the two never disagree. Prometheus is attached once the model id is known (`attach`); counts
    made before reach Prometheus then."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}
        self._metrics: Metrics | None = None

    def attach(self, metrics: Metrics) -> None:
        self._metrics = metrics
        for name, value in self.values.items():
            self._export(name, value)

    def count(self, name: str, n: int = 1) -> None:
        self.values[name] = self.values.get(name, 0) + n
        if self._metrics is not None:
            self._export(name, n)

    def observe_transfer(self, seconds: float) -> None:
        """One request's KV pull or send duration (a histogram: Prometheus only)."""
        if self._metrics is not None:
            self._metrics.lab(self._metrics.kv_transfer_time).observe(seconds)

    def _export(self, name: str, n: int) -> None:
        attribute = PROMETHEUS_COUNTER_OF.get(name)
        if attribute is not None and n:
            self._metrics.lab(getattr(self._metrics, attribute)).inc(n)


def serve_http(registry: CollectorRegistry, host: str, port: int) -> ThreadingHTTPServer:
    """Serve /metrics on its own HTTP port (gRPC-only processes); returns the running server.

    Always the plain text format: prometheus_client's own server answers a scraper that asks
    for OpenMetrics by renaming `splitserve:x` to `splitserve_x`, which no dashboard query finds.
    """

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
