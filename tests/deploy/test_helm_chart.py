"""deploy/helm/splitserve rendered for every values file in its ci/ folder: each manifest passes its schema, and
each pool, its discovery, drain, model source, GPUs and certificates come out as the values ask (the autoscalers,
scrape config and dashboard: test_helm_autoscaling.py)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from tests.deploy.chart import (
    CHART,
    REPO,
    VALUES_FILES,
    by_kind,
    container,
    flag,
    lint,
    load_values,
    notes,
    render,
    schema_errors,
)

pytestmark = pytest.mark.slow  # Helm's engine, loaded once per process (~0.2 s a render, ~0.5 s of schema checks)

POOLS = ("prefill", "decode", "worker")


def rendered(name: str) -> dict[tuple[str, str], dict]:
    return by_kind(render(load_values(CHART / "ci" / f"{name}-values.yaml")))


def test_the_ci_values_files_are_the_seven_cases():
    assert [p.name for p in VALUES_FILES] == [
        "default-values.yaml",
        "gpu-tp2-values.yaml",
        "hf-model-values.yaml",
        "hostpath-model-values.yaml",
        "hpa-values.yaml",
        "keda-values.yaml",
        "mtls-values.yaml",
    ]


EXPECTED_OBJECTS = {
    "default": [],
    "gpu-tp2": [],
    "hf-model": [],
    "hostpath-model": [],
    "hpa": [
        ("HorizontalPodAutoscaler", "splitserve-decode"),
        ("HorizontalPodAutoscaler", "splitserve-prefill"),
        ("ServiceMonitor", "splitserve-engine"),
        ("ServiceMonitor", "splitserve-gateway"),
    ],
    "keda": [
        ("ScaledObject", "splitserve-decode"),
        ("ScaledObject", "splitserve-prefill"),
        ("ScaledObject", "splitserve-worker"),
        ("Service", "splitserve-worker"),
        ("StatefulSet", "splitserve-worker"),
    ],
    "mtls": [("Service", "splitserve-worker"), ("StatefulSet", "splitserve-worker")],
}
BASE_OBJECTS = [
    ("ConfigMap", "splitserve-config"),
    ("ConfigMap", "splitserve-dashboard"),
    ("Deployment", "splitserve-gateway"),
    ("Service", "splitserve-decode"),
    ("Service", "splitserve-gateway"),
    ("Service", "splitserve-prefill"),
    ("StatefulSet", "splitserve-decode"),
    ("StatefulSet", "splitserve-prefill"),
]


@pytest.mark.parametrize("path", VALUES_FILES, ids=lambda p: p.name.removesuffix("-values.yaml"))
def test_every_values_file_renders_objects_that_pass_their_schemas(path):
    docs = render(load_values(path))
    case = path.name.removesuffix("-values.yaml")
    linted = lint(load_values(path))  # helm lint --strict: only its advice to add an icon (severity 1, info)
    assert (linted["errors"], linted["messages"]) == (
        [],
        [{"severity": 1, "path": "Chart.yaml", "error": "icon is recommended"}],
    )
    assert sorted(by_kind(docs)) == sorted(BASE_OBJECTS + EXPECTED_OBJECTS[case])
    assert [error for doc in docs for error in schema_errors(doc)] == []
    for doc in docs:
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == "splitserve", doc["metadata"]


def test_the_schema_check_refuses_a_misspelt_field_or_a_wrong_type():
    """The checks above cannot pass by ignoring what they do not know."""
    objects = rendered("keda")
    decode = copy.deepcopy(objects[("StatefulSet", "splitserve-decode")])
    container(decode)["resourcez"] = {}
    decode["spec"]["replicas"] = "3"
    errors = schema_errors(decode)
    for version in ("1.27.0", "1.37.0"):
        assert f"StatefulSet on {version}: spec.replicas: '3' is not of type 'integer', 'null'" in errors
    scaled = copy.deepcopy(objects[("ScaledObject", "splitserve-decode")])
    scaled["spec"]["minReplicas"] = 1  # KEDA's field is minReplicaCount
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 24  # KEDA takes strings only
    assert schema_errors(scaled) == [
        "ScaledObject: spec: Additional properties are not allowed ('minReplicas' was unexpected)",
        "ScaledObject: spec.triggers.0.metadata.threshold: 24 is not of type 'string'",
    ]
    monitor = copy.deepcopy(rendered("hpa")[("ServiceMonitor", "splitserve-engine")])
    monitor["spec"]["endpoints"][0]["honor_labels"] = True
    assert schema_errors(monitor) == [
        "ServiceMonitor: spec.endpoints.0: Additional properties are not allowed ('honor_labels' was unexpected)"
    ]


def test_pools_are_statefulsets_behind_headless_services_the_gateway_resolves():
    objects = rendered("default")
    for role, port, replicas in (("prefill", 50061, 1), ("decode", 50071, 2)):
        name = f"splitserve-{role}"
        service, pool = objects[("Service", name)], objects[("StatefulSet", name)]
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is False
        assert (
            service["spec"]["selector"]
            == pool["spec"]["selector"]["matchLabels"]
            == {
                "app.kubernetes.io/name": "splitserve",
                "app.kubernetes.io/instance": "splitserve",
                "app.kubernetes.io/component": role,
            }
        )
        assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [("grpc", port), ("metrics", 9100)]
        assert pool["spec"]["serviceName"] == name and pool["spec"]["replicas"] == replicas
        assert pool["spec"]["podManagementPolicy"] == "Parallel"
        c = container(pool)
        assert c["args"] == [
            role,
            "--host", "$(POD_IP)",
            "--port", str(port),
            "--metrics-port", "9100",
            "--instance-name", "$(POD_NAME)",
            "--device", "cpu",
            "--tensor-parallel-size", "1",
        ]  # fmt: skip
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["exec"] == {"command": ["splitserve-healthcheck", "grpc", f"${{POD_IP}}:{port}"]}
        assert "nvidia.com/gpu" not in c["resources"]["limits"]
    gateway = container(objects[("Deployment", "splitserve-gateway")])
    assert flag(gateway["args"], "--prefill") == "dns:///splitserve-prefill.llm.svc.cluster.local:50061"
    assert flag(gateway["args"], "--decode") == "dns:///splitserve-decode.llm.svc.cluster.local:50071"
    assert "--discovery-interval-s" not in gateway["args"] and "--model" not in gateway["args"]
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}


def test_workers_join_the_decode_list_and_the_discovery_interval_is_passed_when_set():
    objects = by_kind(render({"worker": {"enabled": True}, "gateway": {"discoveryIntervalS": "2"}}))
    args = container(objects[("Deployment", "splitserve-gateway")])["args"]
    assert flag(args, "--decode") == (
        "dns:///splitserve-decode.llm.svc.cluster.local:50071,dns:///splitserve-worker.llm.svc.cluster.local:50081"
    )
    assert flag(args, "--discovery-interval-s") == "2"
    assert container(objects[("StatefulSet", "splitserve-worker")])["args"][:3] == ["worker", "--host", "$(POD_IP)"]
    alone = by_kind(render({"prefill": {"enabled": False}, "decode": {"enabled": False}, "worker": {"enabled": True}}))
    args = container(alone[("Deployment", "splitserve-gateway")])["args"]
    assert "--prefill" not in args and flag(args, "--decode").startswith("dns:///splitserve-worker.llm.svc.")
    assert ("StatefulSet", "splitserve-decode") not in alone


def test_scaling_a_pool_is_one_number_that_leaves_the_gateway_untouched():
    """A new replica count changes that StatefulSet only: the gateway's pod template (and so its pods) stays."""
    before, after = by_kind(render()), by_kind(render({"decode": {"replicas": 7}}))
    assert after[("StatefulSet", "splitserve-decode")]["spec"]["replicas"] == 7
    changed = sorted(key for key in before if before[key] != after[key])
    assert changed == [("StatefulSet", "splitserve-decode")]


def test_scale_down_drains_within_the_termination_grace():
    """SIGTERM starts a drain of drain_grace_s; preStop comes first; the pod is killed only after both."""
    objects = by_kind(render({"drain": {"longestStreamSeconds": 900, "preStopSeconds": 7}}))
    settings = objects[("ConfigMap", "splitserve-config")]["data"]
    assert settings["SPLITSERVE_DRAIN_GRACE_S"] == "900"
    for key in (("StatefulSet", "splitserve-prefill"), ("StatefulSet", "splitserve-decode")) + (
        ("Deployment", "splitserve-gateway"),
    ):
        spec = objects[key]["spec"]["template"]["spec"]
        assert spec["terminationGracePeriodSeconds"] == 7 + 900 + 15, key
        assert container(objects[key])["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "7"]}}, key
        assert container(objects[key])["envFrom"] == [{"configMapRef": {"name": "splitserve-config"}}]
    gateway = container(objects[("Deployment", "splitserve-gateway")])
    assert flag(gateway["args"], "--request-timeout-s") == "900"  # no stream outlives the drain


def test_gpu_pools_get_one_gpu_per_tensor_parallel_rank_and_the_pvc_model():
    objects = rendered("gpu-tp2")
    for role, replicas in (("prefill", 2), ("decode", 4)):
        pool = objects[("StatefulSet", f"splitserve-{role}")]
        c = container(pool)
        assert pool["spec"]["replicas"] == replicas
        assert flag(c["args"], "--device") == "cuda" and flag(c["args"], "--tensor-parallel-size") == "2"
        assert flag(c["args"], "--model") == "/models/Qwen3-8B"
        assert c["resources"] == {
            "requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": 2},
            "limits": {"memory": "96Gi", "nvidia.com/gpu": 2},
        }
        spec = pool["spec"]["template"]["spec"]
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in spec["volumes"]
        assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["SPLITSERVE_KV_CACHE_MEMORY_FRACTION"] == "0.9" and env["NCCL_SOCKET_IFNAME"] == "eth0"
    gateway = objects[("Deployment", "splitserve-gateway")]
    assert flag(container(gateway)["args"], "--model") == "/models/Qwen3-8B"  # its tokenizer
    assert "nvidia.com/gpu" not in json.dumps(gateway)


def test_a_host_path_model_and_a_hugging_face_id_with_its_cache():
    objects = rendered("hostpath-model")
    for key in (("StatefulSet", "splitserve-decode"), ("Deployment", "splitserve-gateway")):
        spec = objects[key]["spec"]["template"]["spec"]
        assert {"name": "model", "hostPath": {"path": "/mnt/models", "type": "Directory"}} in spec["volumes"]
        assert flag(container(objects[key])["args"], "--model") == "/models/Llama-3.1-8B-Instruct"
    gateway_args = container(objects[("Deployment", "splitserve-gateway")])["args"]
    assert flag(gateway_args, "--served-model-name") == "llama-3.1-8b"
    # every process labels its metrics with the first served name (the dashboard's $model comes from the engines)
    assert flag(container(objects[("StatefulSet", "splitserve-decode")])["args"], "--served-model-name") == (
        "llama-3.1-8b"
    )

    objects = rendered("hf-model")
    assert objects[("ConfigMap", "splitserve-config")]["data"]["HF_HOME"] == "/var/cache/huggingface"
    for key in (("StatefulSet", "splitserve-prefill"), ("Deployment", "splitserve-gateway")):
        c, spec = container(objects[key]), objects[key]["spec"]["template"]["spec"]
        assert flag(c["args"], "--model") == "Qwen/Qwen3-0.6B" and flag(c["args"], "--revision") == "main"
        assert {"name": "hf-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}} in spec["volumes"]
        assert {"name": "hf-cache", "mountPath": "/var/cache/huggingface"} in c["volumeMounts"]
        token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
        assert token in c["env"]
    per_pod = by_kind(render({"model": {"source": "huggingface", "id": "Qwen/Qwen3-0.6B"}}))
    spec = per_pod[("StatefulSet", "splitserve-decode")]["spec"]["template"]["spec"]
    assert {"name": "hf-cache", "emptyDir": {"sizeLimit": "64Gi"}} in spec["volumes"]
    assert "HF_TOKEN" not in json.dumps(per_pod[("StatefulSet", "splitserve-decode")])


def test_internal_token_and_one_certificate_secret_per_role():
    objects = rendered("mtls")
    settings = objects[("ConfigMap", "splitserve-config")]["data"]
    assert {k: v for k, v in settings.items() if k.startswith("SPLITSERVE_INTERNAL_TLS_")} == {
        "SPLITSERVE_INTERNAL_TLS_CERT": "/etc/splitserve/tls/tls.crt",
        "SPLITSERVE_INTERNAL_TLS_KEY": "/etc/splitserve/tls/tls.key",
        "SPLITSERVE_INTERNAL_TLS_CA": "/etc/splitserve/tls/ca.crt",
        "SPLITSERVE_INTERNAL_TLS_SERVER_NAME": "splitserve-internal",
    }
    assert settings["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability.svc:4317"
    token = {"secretKeyRef": {"name": "splitserve-internal", "key": "token"}}
    for role in ("gateway", *POOLS):
        key = ("Deployment", "splitserve-gateway") if role == "gateway" else ("StatefulSet", f"splitserve-{role}")
        c, spec = container(objects[key]), objects[key]["spec"]["template"]["spec"]
        assert {"name": "internal-tls", "mountPath": "/etc/splitserve/tls", "readOnly": True} in c["volumeMounts"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["internal-tls"]["secret"] == {"secretName": f"llm-tls-{role}", "defaultMode": 0o440}
        assert {e["name"]: e.get("valueFrom") for e in c["env"]}["SPLITSERVE_INTERNAL_TOKEN"] == token
        assert spec["securityContext"]["fsGroup"] == 10001  # the 0440 key is readable by the group
    plain = by_kind(render({"internalToken": {"existingSecret": ""}}))
    assert "SPLITSERVE_INTERNAL_TOKEN" not in json.dumps(list(plain.values()))
    assert "TLS" not in json.dumps(plain["ConfigMap", "splitserve-config"])
    assert "WARNING: internalToken.existingSecret is empty" in notes({"internalToken": {"existingSecret": ""}})


def test_every_flag_and_setting_the_chart_passes_is_a_real_option():
    from splitserve.common.config import EngineConfig
    from splitserve.common.config_fields import env_name, flag_name
    from splitserve.engine_service.config import ServiceConfig
    from splitserve.gateway.config import GatewayConfig

    def options(*classes) -> set[str]:
        return {flag_name(f.name) for cls in classes for f in dataclasses.fields(cls)}

    engine_flags, gateway_flags = options(EngineConfig, ServiceConfig), options(GatewayConfig)
    env = {env_name(f.name) for cls in (EngineConfig, ServiceConfig, GatewayConfig) for f in dataclasses.fields(cls)}
    env.add("SPLITSERVE_TRACING")  # read by runtime/tracing.py, not a config field
    for path in VALUES_FILES:
        objects = render(load_values(path))
        for doc in objects:
            if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "splitserve-config":
                assert {k for k in doc["data"] if k.startswith("SPLITSERVE_")} <= env, path.name
            if doc["kind"] not in ("StatefulSet", "Deployment"):
                continue
            c = container(doc)
            known = gateway_flags if doc["kind"] == "Deployment" else engine_flags
            assert {a for a in c["args"] if a.startswith("--")} <= known, (path.name, doc["metadata"]["name"])
            assert {e["name"] for e in c["env"] if e["name"].startswith("SPLITSERVE_")} <= env, path.name


BAD_VALUES = [
    ({"decode": {"replicaz": 3}}, "at '/decode': additional properties 'replicaz' not allowed"),
    ({"decode": {"autoscaling": {"minReplicas": 0}}}, "at '/decode/autoscaling/minReplicas': minimum: got 0, want 1"),
    (
        {"prefill": {"autoscaling": {"metric": "requests"}}},
        "at '/prefill/autoscaling/metric': value must be one of 'waiting', 'queueTime'",
    ),
    (
        {"decode": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
        "decode.autoscaling.minReplicas (5) is above maxReplicas (2)",
    ),
    ({"model": {"source": "pvc"}}, "model.pvc.claimName is required when model.source is pvc"),
    ({"model": {"source": "huggingface"}}, "model.id is required when model.source is huggingface"),
    (
        {"internalTls": {"enabled": True, "secrets": {"decode": ""}}},
        "internalTls.secrets.decode is required when internalTls.enabled",
    ),
    (
        {"decode": {"enabled": False}, "worker": {"enabled": True}},
        "prefill.enabled needs decode.enabled: a prefill hands its KV to a decode",
    ),
    ({"prefill": {"enabled": False}, "decode": {"enabled": False}}, "enable decode or worker"),
]


@pytest.mark.parametrize("values, message", BAD_VALUES)
def test_bad_values_fail_naming_the_key(values, message):
    import helm_python

    with pytest.raises((helm_python.HelmValuesError, helm_python.HelmRenderError)) as info:
        render(values)
    assert message in str(info.value)


def test_the_template_script_renders_as_helm_template_with_values_files_and_set():
    import subprocess
    import sys

    import yaml

    script = [sys.executable, str(REPO / "scripts/helm-template.py"), "rel", str(CHART), "-n", "ns"]
    keda = str(CHART / "ci/keda-values.yaml")
    done = subprocess.run([*script, "-f", keda, "--set", "decode.autoscaling.enabled=false,decode.replicas=5"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    objects = by_kind([doc for doc in yaml.safe_load_all(done.stdout) if doc])
    assert objects == by_kind(
        render({**load_values(CHART / "ci/keda-values.yaml"), "decode": {"replicas": 5}}, release="rel", namespace="ns")
    )
    assert objects[("StatefulSet", "rel-splitserve-decode")]["spec"]["replicas"] == 5
    assert ("ScaledObject", "rel-splitserve-decode") not in objects and (
        "ScaledObject",
        "rel-splitserve-prefill",
    ) in objects
    refused = subprocess.run([*script, "--set", "gateway.replicas=-1"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "at '/gateway/replicas': minimum: got -1, want 0" in refused.stderr
