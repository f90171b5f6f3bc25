"""The package layout: one import root in the wheel, a gateway process without torch, the layer rules."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.service_harness import REPO, Proc, free_port, gateway_args, wait_until


def workspace_parts() -> list[str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["uv"]["workspace"]["members"]


def test_every_module_path_contains_its_import_path():
    """Each part's code is at <part>/splitserve/<part>/: no top-level folder is importable itself (no
    __init__.py at a part's top or in its splitserve/), and a module's file path ends in its import path."""
    assert workspace_parts() == [
        "protos",
        "common",
        "runtime",
        "kernels",
        "engine",
        "engine_service",
        "prefill_service",
        "decode_service",
        "gateway",
        "cli",
        "bench",
    ]
    for part in workspace_parts():
        assert not (REPO / part / "__init__.py").exists(), part
        assert not (REPO / part / "splitserve" / "__init__.py").exists(), part
        assert sorted(p.name for p in (REPO / part / "splitserve").iterdir() if p.name != "__pycache__") == [part]
    for path in REPO.glob("*/splitserve/**/*.py"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts[1:]).removesuffix(".__init__")
        assert importlib.util.find_spec(module).origin == str(path), module


# Each part's wheel from the build backend its pyproject.toml names, called as pip calls it (PEP 517's build_wheel,
# no isolation), every part in this one process: a pip per part took 25 s of CPU for the 11, this 3 s, the same files.
BUILD_WHEELS = """
import importlib, os, sys, tomllib
out, parts = sys.argv[1], sys.argv[2:]  # read first: setuptools' build_wheel rewrites sys.argv
for part in parts:
    os.chdir(part)
    with open("pyproject.toml", "rb") as f:
        backend = importlib.import_module(tomllib.load(f)["build-system"]["build-backend"])
    backend.build_wheel(out)
"""


@pytest.mark.slow
def test_each_parts_wheel_holds_its_own_package(tmp_path):
    parts = workspace_parts()
    argv = [sys.executable, "-c", BUILD_WHEELS, str(tmp_path), *(str(REPO / part) for part in parts)]
    built = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    for part in parts:
        (wheel,) = tmp_path.glob(f"splitserve_{part}-*.whl")
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
        code = {n.rsplit("/", 1)[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
        assert {"/".join(n.split("/")[:2]) for n in code} == {f"splitserve/{part}"}, part
        assert "splitserve/__init__.py" not in names, part
        if part == "cli":
            entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt")))
            assert "splitserve = splitserve.cli:main" in entry_points.decode()
        if part == "common":
            assert "splitserve/common/default_model/model.safetensors" in names


@pytest.mark.slow
def test_the_gateway_part_alone_installs_from_the_lock_and_serves_without_torch(tmp_path):
    """The gateway part's closure from uv.lock in a fresh environment: no torch, and `splitserve gateway` answers."""
    venv = tmp_path / "venv"
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(venv)}
    subprocess.run(
        ["bash", str(REPO / "scripts" / "uv.sh"), "sync", "--frozen", "--quiet", "--package", "splitserve-gateway"],
        check=True,
        cwd=REPO,
        env=env,
    )
    python = str(venv / "bin" / "python")
    names = subprocess.run(
        [
            python,
            "-P",
            "-c",
            "import importlib.metadata as m; print(*sorted(d.metadata['Name'] for d in m.distributions()))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert [n for n in names if n.startswith("splitserve")] == [
        "splitserve-cli",
        "splitserve-common",
        "splitserve-gateway",
        "splitserve-protos",
        "splitserve-runtime",
    ]
    assert not {"torch", "triton", "transformers", "xgrammar", "safetensors"} & {n.lower() for n in names}
    http_port = free_port()
    argv = [
        str(venv / "bin" / "splitserve"),
        "gateway",
        *gateway_args(free_port(), http_port, f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"),
    ]
    log = tmp_path / "gateway.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:

        def live() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{http_port}/live", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(live, 60, lambda: "the gateway never answered /live:\n" + log.read_text())
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.slow
def test_a_running_gateway_has_loaded_no_torch(tmp_path):
    """`splitserve gateway` starts, loads its tokenizer, serves /health, and no torch library is mapped."""
    http_port = free_port()
    proc = Proc(
        "gateway",
        gateway_args(free_port(), http_port, f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"),
        tmp_path,
        "gateway",
    )
    try:

        def answers() -> bool:
            assert proc.popen.poll() is None, proc.log_path.read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=1).status_code > 0
            except httpx.HTTPError:
                return False

        wait_until(answers, 120, lambda: "the gateway never answered /health:\n" + proc.log_path.read_text())
        maps = Path(f"/proc/{proc.popen.pid}/maps").read_text()
        assert "tokenizers" in maps, "the gateway should have loaded its tokenizer (the check would be vacuous)"
        torch_libs = sorted({line.split()[-1] for line in maps.splitlines() if "/torch/" in line})
        assert torch_libs == []
    finally:
        proc.stop()


@pytest.mark.slow
def test_importing_the_gateway_loads_no_torch():
    code = (
        "import sys\nimport splitserve.gateway.server, splitserve.gateway.rest, splitserve.cli.supervisor\n"
        "from splitserve.common.tokenizer import load_tokenizer\n"
        "from splitserve.common.default_model_path import default_model_path\n"
        "load_tokenizer(str(default_model_path()))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'safetensors')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow
def test_with_tracing_off_nothing_imports_opentelemetry():
    """A machine without the OpenTelemetry SDK runs every service's tracing path with tracing
    off (fastapi itself needs opentelemetry-api, so the REST shim is left out here)."""
    code = """
import sys

class NoOtel:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ImportError(f"{name} is not installed here")
        return None

sys.meta_path.insert(0, NoOtel())
from splitserve.runtime import tracing
from splitserve.runtime.logs import _current_trace_id
import splitserve.gateway.service, splitserve.gateway.grpc_api, splitserve.gateway.request_run
import splitserve.decode_service.pulls, splitserve.prefill_service.server
assert tracing.init_tracing("t", "t") is False
span = tracing.start_span("request", tracing.extract({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}))
tracing.record_span("x", 1, 2, span)
with tracing.span("y") as inner:
    inner.set_attribute("k", 1)
assert tracing.inject(span) == {} and tracing.metadata_carrier([("traceparent", "x")]) == {}
tracing.end_span(span, "error")
assert tracing.context_of(span) is None and _current_trace_id() is None
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
