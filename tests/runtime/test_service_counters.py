"""ServiceCounters: one call per fact feeds both Describe's counters and Prometheus."""

from prometheus_client import generate_latest

from splitserve.runtime.metrics import PROMETHEUS_COUNTER_OF, Metrics, ServiceCounters


def sample(metrics: Metrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name, {"model_name": "m", "instance": "d0"})
    return 0.0 if value is None else value


def test_counts_before_and_after_prometheus_is_attached_agree():
    counters = ServiceCounters()
    counters.count("kv_bytes_pulled", 4096)  # before the model id is known: no Prometheus yet
    counters.count("requests_received")
    metrics = Metrics("m", "d0", "decode")
    counters.attach(metrics)
    counters.count("kv_bytes_pulled", 1024)
    counters.count("kv_pull_failures")
    counters.count("leases_expired", 2)
    assert counters.values == {
        "kv_bytes_pulled": 5120,
        "requests_received": 1,
        "kv_pull_failures": 1,
        "leases_expired": 2,
    }
    assert sample(metrics, "splitserve:kv_transfer_bytes_total") == 5120
    assert sample(metrics, "splitserve:kv_transfer_failures_total") == 1
    assert sample(metrics, "splitserve:kv_leases_expired_total") == 2
    assert b"requests_received" not in generate_latest(metrics.registry)  # a Describe-only counter


def test_every_mapped_counter_names_a_prometheus_counter():
    metrics = Metrics("m", "d0", "decode")
    for name, attribute in PROMETHEUS_COUNTER_OF.items():
        assert type(getattr(metrics, attribute)).__name__ == "Counter", (name, attribute)


def test_transfer_durations_reach_the_histogram_once_attached():
    counters = ServiceCounters()
    counters.observe_transfer(0.5)  # dropped: a histogram has no Describe counterpart to replay from
    metrics = Metrics("m", "d0", "decode")
    counters.attach(metrics)
    counters.observe_transfer(0.25)
    assert sample(metrics, "splitserve:kv_transfer_duration_seconds_count") == 1
    assert sample(metrics, "splitserve:kv_transfer_duration_seconds_sum") == 0.25


def test_the_metrics_vllm_exports_are_exported_under_its_names_too():
    """Dashboards, autoscalers and routers written for vLLM read vllm:* with model_name."""
    from splitserve.runtime.metrics import VLLM_NAMES

    metrics = Metrics("m", "d0", "decode")
    metrics.observe_engine_stats({"num_running": 3, "num_waiting": 2, "num_total_blocks": 10, "num_free_blocks": 4})
    metrics.lab(metrics.generation_tokens).inc(7)
    metrics.lab(metrics.ttft).observe(0.25)
    metrics.lab(metrics.request_success, finished_reason="stop").inc()
    labels = {"model_name": "m", "instance": "d0"}
    for name, value in [
        ("num_requests_running", 3),
        ("num_requests_waiting", 2),
        ("kv_cache_usage_perc", 0.6),
        ("generation_tokens_total", 7),
        ("time_to_first_token_seconds_count", 1),
        ("time_to_first_token_seconds_sum", 0.25),
    ]:
        ours = metrics.registry.get_sample_value("splitserve:" + name, labels)
        theirs = metrics.registry.get_sample_value("vllm:" + name, labels)
        assert ours == theirs == value, name
    assert metrics.registry.get_sample_value("vllm:request_success_total", {**labels, "finished_reason": "stop"}) == 1
    exported = {m.name for m in metrics.registry.collect()}
    assert {n.removesuffix("_total") for n in VLLM_NAMES} <= {n.removeprefix("vllm:") for n in exported}
    assert "vllm:requests" not in exported  # the gateway's route/status counter is ours alone
