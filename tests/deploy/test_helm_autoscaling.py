"""deploy/helm/splitserve's autoscalers (KEDA or HPA, one per pool on its own metric), its Prometheus scrape
config and its Grafana dashboard, as the values ask. The queries themselves run on a real Prometheus in
tests/integration/test_deploy.py."""

from __future__ import annotations

import json
import re

import pytest

from tests.deploy.chart import CHART, REPO, by_kind, load_values, render

pytestmark = pytest.mark.slow  # Helm's engine

DASHBOARD = REPO / "deploy/grafana/dashboards/splitserve.json"


def rendered(name: str) -> dict[tuple[str, str], dict]:
    return by_kind(render(load_values(CHART / "ci" / f"{name}-values.yaml")))


def test_keda_scales_each_pool_on_its_own_metric_with_a_slow_scale_down():
    objects = rendered("keda")
    selector = 'namespace="llm",pod=~"splitserve-{}-[0-9]+"'
    expected = {
        "prefill": (
            "Value",
            "histogram_quantile(0.9, sum by (le) (rate(vllm:request_queue_time_seconds_bucket{"
            + selector.format("prefill")
            + "}[2m])))",
            "0.5",
            (1, 4),
        ),
        "decode": (
            "AverageValue",
            'sum({__name__=~"vllm:num_requests_running|vllm:num_requests_waiting",' + selector.format("decode") + "})",
            "24",
            (2, 16),
        ),
        "worker": ("AverageValue", "sum(vllm:kv_cache_usage_perc{" + selector.format("worker") + "})", "0.8", (1, 3)),
    }
    for role, (metric_type, query, threshold, (low, high)) in expected.items():
        spec = objects[("ScaledObject", f"splitserve-{role}")]["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": f"splitserve-{role}"}
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (low, high)
        assert (spec["pollingInterval"], spec["cooldownPeriod"]) == (10, 120)
        assert spec["triggers"] == [
            {
                "type": "prometheus",
                "metricType": metric_type,
                "metadata": {
                    "serverAddress": "http://prometheus-operated.monitoring.svc:9090",
                    "query": query,
                    "threshold": threshold,
                },
            }
        ]
        assert "replicas" not in objects[("StatefulSet", f"splitserve-{role}")]["spec"]  # the autoscaler's
    behavior = objects[("ScaledObject", "splitserve-decode")]["spec"]["advanced"]["horizontalPodAutoscalerConfig"]
    assert behavior["behavior"]["scaleDown"] == {
        "stabilizationWindowSeconds": 600,
        "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}],
    }
    own = by_kind(render({"decode": {"autoscaling": {"enabled": True, "query": "sum(my_load)"}}}))
    assert own[("ScaledObject", "splitserve-decode")]["spec"]["triggers"][0]["metadata"]["query"] == "sum(my_load)"


def test_hpa_reads_the_adapters_metrics_and_the_service_monitors_keep_the_dashboards_jobs():
    objects = rendered("hpa")
    prefill = objects[("HorizontalPodAutoscaler", "splitserve-prefill")]["spec"]
    assert (prefill["minReplicas"], prefill["maxReplicas"]) == (1, 6)
    assert prefill["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "vllm_num_requests_waiting"},
                "target": {"type": "AverageValue", "averageValue": "2"},
            },
        }
    ]
    decode = objects[("HorizontalPodAutoscaler", "splitserve-decode")]["spec"]
    assert decode["metrics"][0]["pods"] == {
        "metric": {"name": "vllm_kv_cache_usage_perc"},
        "target": {"type": "AverageValue", "averageValue": "0.75"},
    }
    assert decode["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    queue = by_kind(
        render(
            {
                "autoscaling": {"kind": "hpa"},
                "prefill": {"autoscaling": {"enabled": True, "metric": "queueTime", "target": "1.5"}},
            }
        )
    )
    assert queue[("HorizontalPodAutoscaler", "splitserve-prefill")]["spec"]["metrics"] == [
        {
            "type": "External",
            "external": {
                "metric": {
                    "name": "splitserve_queue_time_p90_seconds",
                    "selector": {"matchLabels": {"namespace": "llm", "pool": "splitserve-prefill"}},
                },
                "target": {"type": "Value", "value": "1.5"},
            },
        }
    ]
    engines, gateway = (
        objects[("ServiceMonitor", "splitserve-engine")],
        objects[("ServiceMonitor", "splitserve-gateway")],
    )
    for monitor, scrape, port, honor in ((engines, "engine", "metrics", True), (gateway, "gateway", "http", False)):
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert monitor["spec"]["jobLabel"] == "splitserve/job"
        assert monitor["spec"]["selector"]["matchLabels"] == {
            "app.kubernetes.io/instance": "splitserve",
            "splitserve/scrape": scrape,
        }
        (endpoint,) = monitor["spec"]["endpoints"]
        assert (endpoint["port"], endpoint["honorLabels"], endpoint["interval"]) == (port, honor, "10s")
    # the dashboard selects jobs splitserve-gateway|prefill|decode: the Services carry those names
    panels = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])]
    selected = {job for q in panels for value in re.findall(r'job=~?"([^"]+)"', q) for job in value.split("|")}
    assert selected == {"splitserve-gateway", "splitserve-prefill", "splitserve-decode"}
    jobs = {
        name: doc["metadata"]["labels"].get("splitserve/job")
        for (kind, name), doc in objects.items()
        if kind == "Service"
    }
    assert jobs == {
        "splitserve-prefill": "splitserve-prefill",
        "splitserve-decode": "splitserve-decode",
        "splitserve-gateway": "splitserve-gateway",
    }


def test_the_dashboard_configmap_is_the_shipped_dashboard():
    board = rendered("default")[("ConfigMap", "splitserve-dashboard")]
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(board["data"]["splitserve.json"]) == json.loads(DASHBOARD.read_text())
    moved = by_kind(render({"grafana": {"dashboard": {"datasourceUid": "prom-main"}}}))[
        ("ConfigMap", "splitserve-dashboard")
    ]
    text = moved["data"]["splitserve.json"]
    assert "splitserve-prometheus" not in text
    assert text == board["data"]["splitserve.json"].replace('"uid": "splitserve-prometheus"', '"uid": "prom-main"')
    assert ("ConfigMap", "splitserve-dashboard") not in by_kind(render({"grafana": {"dashboard": {"enabled": False}}}))
