"""Which process declares which Prometheus family, with vLLM's names, buckets and labels, every label set at 0
from the start; and every family the Grafana dashboard queries is declared by the role its query scrapes."""

import json
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.runtime.metric_families import FAMILIES, buckets_1_2_5, families_of
from splitserve.runtime.metrics import Metrics, RequestEnd

CACHE = {
    "block_size": 4,
    "cache_dtype": "auto",
    "enable_prefix_caching": True,
    "gpu_memory_utilization": 0.9,
    "num_gpu_blocks": 64,
}
DASHBOARD = Path(__file__).parents[2] / "deploy/grafana/dashboards/splitserve.json"
JOB_ROLES = {"splitserve-gateway": "gateway", "splitserve-prefill": "prefill", "splitserve-decode": "decode"}


def exported(role: str, max_model_len: int = 100) -> dict[str, dict]:
    """{family name: {"type", "samples": {(sample name, labels without model/instance): value}}} at start."""
    metrics = Metrics("m", "i0", role, max_model_len, None if role == "gateway" else CACHE)
    out = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        samples = {}
        for s in family.samples:
            assert (s.labels["model_name"], s.labels["instance"]) == ("m", "i0")
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "instance")))
            samples[(s.name, labels)] = s.value
        out[family.name] = {"type": family.type, "samples": samples}
    return out


def test_each_role_declares_only_the_families_it_owns():
    names = {role: set(exported(role)) for role in ("gateway", "prefill", "decode", "both")}
    assert all(n.startswith("splitserve:gateway_") for n in names["gateway"])
    assert not any(n.startswith("splitserve:gateway_") for role in ("prefill", "decode", "both") for n in names[role])
    per_token = {
        "vllm:inter_token_latency_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:request_decode_time_seconds",
    }
    transfer = {
        "splitserve:kv_transfer_bytes",
        "splitserve:kv_transfer_blocks",
        "splitserve:kv_transfer_duration_seconds",
        "splitserve:kv_transfer_failures",
    }
    assert names["decode"] - names["prefill"] == per_token
    assert names["prefill"] - names["decode"] == {"splitserve:kv_leases_expired"}
    assert names["decode"] - names["both"] == transfer
    assert len(names["gateway"]) == 10 and len(names["prefill"]) == 25 and len(names["decode"]) == 27
    for missing in (
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_params_n",
        "request_params_max_tokens",
        "iteration_tokens_total",
        "request_inference_time_seconds",
        "cache_config_info",
    ):
        assert "vllm:" + missing in names["decode"], missing


# vLLM 0.32's families that no role of ours declares: multimodal, external (connector) prefix caches, sleep
# mode, per-GPU FLOP and byte estimates and admission rejections do not exist here; the rest are not built
# yet. The table of benchmarks/parity_vllm_api.py lists them (docs/performance.md).
NOT_EXPORTED = {
    "vllm:mm_cache_queries", "vllm:mm_cache_hits", "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits", "vllm:engine_sleep_state", "vllm:estimated_flops_per_gpu",
    "vllm:estimated_read_bytes_per_gpu", "vllm:estimated_write_bytes_per_gpu", "vllm:admission_rejections",
    "vllm:num_requests_waiting_by_reason", "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_cached",
    "vllm:prompt_tokens_cached_by_source", "vllm:request_max_num_generation_tokens", "vllm:request_num_preemptions",
    "vllm:request_prefill_kv_computed_tokens", "vllm:tool_call_parser_invocations",
}  # fmt: skip


def test_vllm_families_and_labels_differ_from_vllm_032_as_listed():
    """Every role's vllm: families, none of NOT_EXPORTED; labels model_name and instance where vLLM has
    model_name and engine (its engine index: a disaggregated stack has several processes per model, so the
    label names the process); cache_config_info carries five of vLLM's CacheConfig fields, not its forty."""
    names = set().union(*(exported(role) for role in ("prefill", "decode", "both")))
    ours = {n for n in names if n.startswith("vllm:")}
    assert len(ours) == 23 and not ours & NOT_EXPORTED
    metrics = Metrics("m", "i0", "decode", 100, CACHE)
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            assert {"model_name", "instance"} <= set(sample.labels) and "engine" not in sample.labels
            if family.name == "vllm:cache_config_info":
                assert set(sample.labels) == {"model_name", "instance", *CACHE}


def test_every_label_set_is_zero_at_start_with_vllms_buckets():
    decode = exported("decode", max_model_len=100)
    assert decode["vllm:prompt_tokens"]["samples"] == {("vllm:prompt_tokens_total", ()): 0.0}
    assert decode["vllm:request_success"]["samples"] == {
        ("vllm:request_success_total", (("finished_reason", r),)): 0.0 for r in ("stop", "length", "abort", "error")
    }
    prompt = decode["vllm:request_prompt_tokens"]["samples"]
    assert [dict(lb)["le"] for (n, lb) in prompt if n.endswith("_bucket")] == [
        "1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"
    ]  # fmt: skip
    n_buckets = [dict(lb)["le"] for (n, lb) in decode["vllm:request_params_n"]["samples"] if n.endswith("_bucket")]
    assert n_buckets == ["1.0", "2.0", "5.0", "10.0", "20.0", "+Inf"]
    ttft = [
        dict(lb)["le"] for (n, lb) in decode["vllm:time_to_first_token_seconds"]["samples"] if n.endswith("_bucket")
    ]
    assert ttft[0] == "0.001" and ttft[-2:] == ["2560.0", "+Inf"] and len(ttft) == 23
    info = decode["vllm:cache_config_info"]["samples"]
    assert info == {
        (
            "vllm:cache_config_info",
            (
                ("block_size", "4"),
                ("cache_dtype", "auto"),
                ("enable_prefix_caching", "True"),
                ("gpu_memory_utilization", "0.9"),
                ("num_gpu_blocks", "64"),
            ),
        ): 1.0
    }
    for role in ("gateway", "prefill", "decode", "both"):
        for name, family in exported(role).items():
            assert family["samples"], f"{role}: {name} has no series at start"
            assert not any(s.endswith("_created") for s, _ in family["samples"]), name
            values = [v for (s, _), v in family["samples"].items() if name != "vllm:cache_config_info"]
            assert set(values) <= {0.0}, f"{role}: {name} is not 0 at start"


def test_request_facts_land_in_their_families():
    metrics = Metrics("m", "i0", "decode", 100, CACHE)
    metrics.prompt_done(7, queue_s=0.5, prefill_s=0.25, ttft_s=0.75)
    metrics.request_done(RequestEnd("stop", 12, e2e_s=2.0, inference_s=1.5, n=2, max_tokens=16))
    metrics.observe_step(9)
    metrics.observe_step(0)  # a batch that was no step
    value = metrics.registry.get_sample_value
    labels = {"model_name": "m", "instance": "i0"}
    assert value("vllm:request_prompt_tokens_bucket", {**labels, "le": "5.0"}) == 0
    assert value("vllm:request_prompt_tokens_bucket", {**labels, "le": "10.0"}) == 1
    assert value("vllm:request_generation_tokens_sum", labels) == 12
    assert value("vllm:request_success_total", {**labels, "finished_reason": "stop"}) == 1
    assert value("vllm:request_params_n_bucket", {**labels, "le": "2.0"}) == 1
    assert value("vllm:request_params_max_tokens_sum", labels) == 16
    assert value("vllm:request_inference_time_seconds_sum", labels) == 1.5
    assert value("vllm:e2e_request_latency_seconds_sum", labels) == 2.0
    assert value("vllm:time_to_first_token_seconds_sum", labels) == 0.75
    assert value("vllm:request_queue_time_seconds_sum", labels) == 0.5
    assert value("vllm:iteration_tokens_total_count", labels) == 1
    assert value("vllm:iteration_tokens_total_sum", labels) == 9


def test_buckets_1_2_5_as_vllm_builds_them():
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(4096) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


def test_an_unknown_role_is_refused():
    with pytest.raises(ValueError, match=r"role must be one of \['both', 'decode', 'gateway', 'prefill'\], got 'x'"):
        families_of("x")


def dashboard_queries() -> list[tuple[str, set[str]]]:
    """(metric name, roles its job selector scrapes) of every metric the dashboard's queries read."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            for name, selector in re.findall(r"((?:vllm|splitserve):[a-z_]+)\{([^}]*)\}", target["expr"]):
                jobs = re.search(r'job=~?"([^"]+)"', selector).group(1).split("|")
                out.append((name, {JOB_ROLES[j] for j in jobs}))
    return out


def test_every_dashboard_query_reads_a_family_its_jobs_declare_and_zero_at_start():
    queries = dashboard_queries()
    assert len(queries) >= 21
    samples = {role: {s for f in exported(role).values() for s, _ in f["samples"]} for role in JOB_ROLES.values()}
    for name, roles in queries:
        assert any(name in samples[role] for role in roles), f"{name} is in no series of {sorted(roles)} at start"
    assert {f.name for f in FAMILIES} >= {"vllm:request_success", "splitserve:gateway_requests"}
