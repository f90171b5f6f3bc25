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
    metrics = Metrics("m", "d0", "prefill")  # a prefill declares both the transfer and the lease families
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
    for role in ("prefill", "decode"):
        metrics = Metrics("m", "d0", role)
        for name, attribute in PROMETHEUS_COUNTER_OF.items():
            if role == "decode" and attribute == "kv_leases_expired":
                assert metrics.kv_leases_expired is None  # leases are the prefill's
                continue
            assert type(getattr(metrics, attribute)).__name__ == "Counter", (role, name, attribute)


def test_a_count_of_a_family_the_role_does_not_declare_reaches_describe_only():
    counters = ServiceCounters()
    metrics = Metrics("m", "w0", "both")  # a colocated worker moves no KV
    counters.attach(metrics)
    counters.count("kv_bytes_pulled", 10)
    assert counters.values == {"kv_bytes_pulled": 10}
    assert b"kv_transfer" not in generate_latest(metrics.registry)


def test_transfer_durations_reach_the_histogram_once_attached():
    counters = ServiceCounters()
    counters.observe_transfer(0.5)  # dropped: a histogram has no Describe counterpart to replay from
    metrics = Metrics("m", "d0", "decode")
    counters.attach(metrics)
    counters.observe_transfer(0.25)
    assert sample(metrics, "splitserve:kv_transfer_duration_seconds_count") == 1
    assert sample(metrics, "splitserve:kv_transfer_duration_seconds_sum") == 0.25
