"""What clients see, as Prometheus metrics: per-request latencies, tokens and call counts.

The gateway's own facts, named `splitserve:gateway_*` (the engines export the `vllm:` ones, each fact once;
runtime/metric_families.py):

    requests_total{route,status}   every REST call (route = path, or "other"; status = HTTP
                                   code) and every Generation gRPC call (route = full method;
                                   status = gRPC code name), refusals included; /metrics is
                                   not counted
    time_to_first_token_seconds    arrival at the gateway -> first message with tokens
    inter_token_latency_seconds    one observation per output token after the first: the gap
                                   since the previous message spread evenly over its tokens
    request_time_per_output_token_seconds   (last token - first token) / (tokens - 1), per
                                   request with at least 2 output tokens
    e2e_request_latency_seconds    arrival -> end, per request that produced a message
    prompt_tokens_total / generation_tokens_total / request_success_total{finished_reason}
                                   per request that produced a message (tokens the client got)
    num_requests_running           requests in flight at the gateway
    pool_members{pool,state}       members of the prefill and decode pools: up (routed to), draining (left
                                   the pool or draining, requests finishing), down (not ready or failing)

A request refused before its first message (4xx, 429, 503) only counts in requests_total.
"""

from __future__ import annotations

import time
from typing import Any

from splitserve.protos import common_pb2, generation_pb2
from splitserve.runtime.metrics import Metrics

FINISH_REASON_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


class GatewayMetrics:
    """The gateway's view of `Metrics`; `model_name` may be learnt after start (set_model). `registry` is what
    /metrics shows: this process's metrics, or `exposed` (every gateway process's, summed) when given."""

    def __init__(self, metrics: Metrics, exposed: Any = None) -> None:
        self.metrics = metrics
        self._exposed = exposed

    @property
    def registry(self):
        return self._exposed if self._exposed is not None else self.metrics.registry

    def set_model(self, model_name: str) -> None:
        """Label later observations with `model_name` (the served model, once Describe told it)."""
        self.metrics.relabel_model(model_name)

    def count(self, route: str, status: str | int) -> None:
        """One call of `route` answered with `status` (HTTP code or gRPC code name)."""
        self.metrics.lab(self.metrics.gw_requests, route=route, status=str(status)).inc()

    def set_running(self, num_running: int) -> None:
        self.metrics.lab(self.metrics.gw_running).set(num_running)

    def set_pool_members(self, counts: dict[tuple[str, str], int]) -> None:
        """Members per (pool, state), as Members.counts() gives them."""
        for (pool, state), n in counts.items():
            self.metrics.lab(self.metrics.gw_pool_members, pool=pool, state=state).set(n)

    def run(self, arrival_s: float) -> RunObserver:
        """An observer for one admitted request that arrived at `arrival_s` (time.monotonic())."""
        return RunObserver(self.metrics, arrival_s)


class RunObserver:
    """Timestamps of one request's messages; `end` records the request's metrics once."""

    def __init__(self, metrics: Metrics, arrival_s: float) -> None:
        self._m = metrics
        self._arrival_s = arrival_s
        self._first_token_s: float | None = None
        self._last_token_s = 0.0
        self.num_messages = 0
        self.num_output_tokens = 0
        self.finish_reason = ""

    def message(self, message: generation_pb2.GenerateResponse) -> None:
        """A message is about to be sent to the client."""
        now = time.monotonic()
        self.num_messages += 1
        n = len(message.token_ids)
        if n:
            if self._first_token_s is None:
                self._first_token_s = now
                self._m.lab(self._m.gw_ttft).observe(now - self._arrival_s)
                n_gaps, gap_s = n - 1, 0.0  # tokens sent together with the first one arrive with it
            else:
                n_gaps, gap_s = n, (now - self._last_token_s) / n
            itl = self._m.lab(self._m.gw_itl)
            for _ in range(n_gaps):
                itl.observe(gap_s)
            self._last_token_s = now
            self.num_output_tokens += n
        if message.finish_reason:
            self.finish_reason = FINISH_REASON_NAMES.get(message.finish_reason, "error")

    def end(self, num_prompt_tokens: int, closed_early: bool) -> None:
        """The request is over; `closed_early`: the stream was closed before a final message."""
        if not self.num_messages:
            return
        m = self._m
        m.lab(m.gw_e2e).observe(time.monotonic() - self._arrival_s)
        if self.num_output_tokens >= 2 and self._first_token_s is not None:
            m.lab(m.gw_tpot).observe((self._last_token_s - self._first_token_s) / (self.num_output_tokens - 1))
        m.lab(m.gw_prompt_tokens).inc(num_prompt_tokens)
        m.lab(m.gw_generation_tokens).inc(self.num_output_tokens)
        reason = self.finish_reason or ("abort" if closed_early else "error")
        m.lab(m.gw_request_success, finished_reason=reason).inc()
