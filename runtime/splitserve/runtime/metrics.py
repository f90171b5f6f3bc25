"""Prometheus metrics of every splitserve process: which families, and who owns each, is metric_families.py.

Each process builds one `Metrics` for its role on its own registry with constant labels model_name and
instance, and serves it on `/metrics` (gRPC-only processes on a separate HTTP port via `serve_http`).
`ServiceCounters` is an engine service's one sink of event counts, feeding Describe and Prometheus alike.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from splitserve.runtime.metric_families import (
    BY_MAX_MODEL_LEN,
    FAMILIES,
    Family,
    buckets_1_2_5,
    families_of,
)

# vLLM drops the `_created` series too: one series per fact keeps a sum over /metrics a sum of facts.
disable_created_metrics()
_KINDS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


def model_label(served_model_name: str, model_id: str) -> str:
    """The model_name label: the first of the comma-separated served names (vLLM labels its metrics with its
    first --served-model-name, the name clients send), else the model id."""
    names = [name.strip() for name in served_model_name.split(",") if name.strip()]
    return names[0] if names else model_id


class Metrics:
    """The families one process owns (metric_families.py), on its own registry, every label set at 0 from
    the start so that each dashboard panel has a value at the first scrape. A family the role does not own
    is None here."""

    def __init__(
        self,
        model_name: str,
        instance: str,
        role: str,
        max_model_len: int = 8192,
        cache_info: dict[str, object] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.role = role
        self.labels = {"model_name": model_name, "instance": instance}
        self._last_engine: dict[str, int] = {}
        self._children: dict[tuple, object] = {}
        self.families = families_of(role)
        for family in FAMILIES:
            setattr(self, family.attr, None)
        for family in self.families:
            setattr(self, family.attr, self._declare(family, max_model_len))
        if cache_info is not None and self.cache_info is not None:
            self.cache_info.labels(**self.labels, **{k: str(v) for k, v in cache_info.items()}).set(1)
        self.zero()

    def _declare(self, family: Family, max_model_len: int):
        labels = ["model_name", "instance", *family.extra_labels]
        kwargs = {}
        if family.kind == "histogram":
            buckets = family.buckets
            kwargs["buckets"] = buckets_1_2_5(max_model_len) if buckets == BY_MAX_MODEL_LEN else buckets
        elif family.kind == "gauge":  # read only where one role runs as several processes (multiprocess_registry)
            kwargs["multiprocess_mode"] = family.across_processes
        return _KINDS[family.kind](family.name, family.doc, labels, registry=self.registry, **kwargs)

    def zero(self) -> None:
        """Create every label set the families declare for the start (Family.zero_label_sets), at 0."""
        for family in self.families:
            for extra in family.zero_label_sets():
                self.lab(getattr(self, family.attr), **extra)

    def relabel_model(self, model_name: str) -> None:
        """Label later observations with `model_name`; the zero series of the old name go (they never
        counted anything but the time before the model was known)."""
        old = self.labels["model_name"]
        if old == model_name:
            return
        with warnings.catch_warnings():  # multi-process mode keeps the old series in its files (_SeriesOfModel)
            warnings.filterwarnings("ignore", "Removal of labels", UserWarning)
            for family in self.families:
                if not family.extra_labels:
                    with contextlib.suppress(KeyError):
                        getattr(self, family.attr).remove(old, self.labels["instance"])
        self._children = {k: v for k, v in self._children.items() if old not in k[1:2]}
        self.labels["model_name"] = model_name
        self.zero()

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

    def observe_step(self, num_tokens: int) -> None:
        """One engine step computed `num_tokens` tokens (prompt and generated)."""
        if num_tokens > 0:
            self.lab(self.iteration_tokens).observe(num_tokens)

    def prompt_done(self, num_prompt_tokens: int, queue_s: float, prefill_s: float, ttft_s: float) -> None:
        """A prompt computed here produced its first token (the prompt token counter goes through
        ServiceCounters, so Describe agrees)."""
        self.lab(self.request_prompt_tokens).observe(num_prompt_tokens)
        self.lab(self.queue).observe(queue_s)
        self.lab(self.prefill_time).observe(prefill_s)
        self.lab(self.ttft).observe(ttft_s)

    def request_done(self, end: RequestEnd) -> None:
        """A request ended here: its per-request facts (generated tokens go through ServiceCounters)."""
        self.lab(self.request_success, finished_reason=end.finish_reason).inc()
        self.lab(self.request_generation_tokens).observe(end.num_generation_tokens)
        self.lab(self.e2e).observe(end.e2e_s)
        self.lab(self.inference_time).observe(end.inference_s)
        self.lab(self.params_n).observe(end.n)
        if end.max_tokens:
            self.lab(self.params_max_tokens).observe(end.max_tokens)


@dataclass(frozen=True)
class RequestEnd:
    """What an engine records when a request ends there (times in seconds, from arrival at this engine)."""

    finish_reason: str
    num_generation_tokens: int
    e2e_s: float
    inference_s: float
    n: int
    max_tokens: int | None


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
        if self._metrics is not None and self._metrics.kv_transfer_time is not None:
            self._metrics.lab(self._metrics.kv_transfer_time).observe(seconds)

    def _export(self, name: str, n: int) -> None:
        metric = getattr(self._metrics, PROMETHEUS_COUNTER_OF.get(name, ""), None)
        if metric is not None and n:  # None: a Describe-only fact, or a family this role does not declare
            self._metrics.lab(metric).inc(n)


class _SeriesOfModel:
    """prometheus_client's multi-process collector, less the series of a model name other than `labels`'s
    current one: a process that learnt the model's name dropped its zero series of the old name (relabel_model),
    but the files every process writes keep them."""

    def __init__(self, path: str, labels: dict[str, str]) -> None:
        from prometheus_client.multiprocess import MultiProcessCollector

        self._collector = MultiProcessCollector(None, path)
        self._labels = labels

    def collect(self):
        model_name = self._labels["model_name"]
        for family in self._collector.collect():
            family.samples = [s for s in family.samples if s.labels.get("model_name", model_name) == model_name]
            yield family


def multiprocess_registry(path: str, labels: dict[str, str]) -> CollectorRegistry:
    """A registry whose /metrics is the sum over every process of a role that writes its metrics to `path`
    (PROMETHEUS_MULTIPROC_DIR, set before prometheus_client is imported there): counters and histograms
    added up, gauges as their family says (Family.across_processes). `labels`: a Metrics' labels, read at each
    scrape."""
    registry = CollectorRegistry()
    registry.register(_SeriesOfModel(path, labels))
    return registry


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
