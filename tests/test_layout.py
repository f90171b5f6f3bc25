"""The package layout: one import root in the wheel, a gateway process without torch, the layer rules."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.service_harness import REPO, Proc, free_port, gateway_args, wait_until


@pytest.mark.slow
def test_the_wheel_holds_one_top_level_package(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("splitserve-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        top_level = zf.read(next(n for n in names if n.endswith(".dist-info/top_level.txt"))).decode()
        entry_points = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert top_level.split() == ["splitserve"]
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"splitserve"}
    packages = {n.rsplit("/", 1)[0] for n in names if n.endswith(".py")}
    assert packages == {
        "splitserve/" + p
        for p in (
            "protos",
            "common",
            "runtime",
            "engine",
            "engine/kv_transfer",
            "engine/models",
            "kernels",
            "prefill_service",
            "decode_service",
            "gateway",
            "cli",
            "bench",
        )
    }
    # each mapped folder ships once, under its own name; the GPU probes and training stay in the repository
    assert "splitserve/engine/common/wire.py" not in names and "splitserve/common/wire.py" in names
    assert "splitserve/bench/serve.py" in names and "splitserve/bench/kernels.py" not in names
    assert "splitserve/common/default_model/model.safetensors" in names
    assert "splitserve = splitserve.cli:main" in entry_points


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
        "import sys\nimport splitserve.gateway.server, splitserve.gateway.rest, splitserve.gateway.up\n"
        "from splitserve.common.tokenizer import load_tokenizer\n"
        "from splitserve.common.default_model_path import default_model_path\n"
        "load_tokenizer(str(default_model_path()))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'safetensors')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow
def test_with_tracing_off_nothing_imports_opentelemetry():
    """Issue 21.4: a machine without the OpenTelemetry SDK runs every service's tracing path with tracing
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
