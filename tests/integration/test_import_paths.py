"""No folder of the checkout shadows a library: not in pytest's process, not in `splitserve up`'s children.

The checkout's top-level folders have generic names (`kernels/` once shadowed Hugging Face's `kernels`, which
transformers >= 5.25 imports). pytest runs in importlib mode and every process starts without the working
directory first on its path; `up` starts its children so that they run the installed package wherever it runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest

from splitserve.cli.local_stack import LocalStack
from tests.service_harness import REPO, free_port, wait_until

SITE_PACKAGES = Path(sysconfig.get_paths()["purelib"]).resolve()
# what a child reports: its sys.path, and where `kernels` and transformers' hub-kernels integration came from
PROBE = """
import json, sys
import kernels
import transformers.integrations.hub_kernels as hub
print(json.dumps({"path": sys.path, "kernels": kernels.__file__, "hub": hub.__file__,
                  "get_kernel": hub.get_kernel_hub.__module__}))
"""


def checkout_entries(path_entries: list[str]) -> list[str]:
    """The entries of a sys.path that are the checkout or a folder inside it (the working directory included),
    other than the virtual environment's own folders (a venv may live inside the checkout)."""
    cwd, prefix = Path.cwd(), Path(sys.prefix).resolve()
    found = []
    for entry in path_entries:
        resolved = (cwd / entry).resolve() if entry else cwd.resolve()
        if not resolved.exists():
            continue  # an import hook's marker, e.g. the editable install's finder
        if resolved.is_relative_to(REPO) and not resolved.is_relative_to(prefix):
            found.append(entry)
    return found


def user_env() -> dict[str, str]:
    """The environment of a shell a user starts `up` from: none of the tests' own guards."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}


def test_pytest_puts_no_checkout_folder_on_the_path():
    assert checkout_entries(sys.path) == []
    import kernels

    assert Path(kernels.__file__).resolve().is_relative_to(SITE_PACKAGES)


@pytest.mark.slow
def test_a_child_started_as_up_starts_them_imports_the_hub_kernels_integration(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)  # where `python -c` would put the checkout first on the path
    stack = LocalStack(env=user_env(), die_with_parent=False, log_dir=str(tmp_path))
    stack.add("probe", [sys.executable, "-c", PROBE])
    try:
        wait_until(lambda: stack.first_exit() is not None, 60, "the probe child did not exit")
    finally:
        stack.stop(1.0)
    assert stack.first_exit() == ("probe", 0), stack.failure_report("probe", stack.procs["probe"].returncode)
    report = json.loads(Path(stack.log_path("probe")).read_text().splitlines()[-1])
    assert checkout_entries(report["path"]) == []
    assert Path(report["kernels"]).resolve().is_relative_to(SITE_PACKAGES)
    assert Path(report["hub"]).resolve().is_relative_to(SITE_PACKAGES)
    assert report["get_kernel"].split(".")[0] == "kernels"


def greedy_text(prompt: str, max_tokens: int) -> str:
    from splitserve.engine import LLM, SamplingParams

    llm = LLM(device="cpu")
    try:
        return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0].text
    finally:
        llm.close()


@pytest.fixture(scope="module")
def expected_answer():
    return greedy_text("def fibonacci(n):", 12)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["checkout", "elsewhere"])
def test_splitserve_up_serves_from_the_checkout_and_from_elsewhere(where, tmp_path, expected_answer):
    """The README's command (the installed `splitserve` script), started from the repository root and from
    another folder in a user's environment, is ready and answers the curl example as the offline engine does."""
    ports = {name: free_port() for name in ("prefill", "decode", "grpc", "http")}
    argv = [str(Path(sys.executable).with_name("splitserve")), "up", "--device", "cpu"]
    argv += [arg for name, port in ports.items() for arg in (f"--{name}-port", str(port))]
    log = tmp_path / "up.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            argv,
            cwd=REPO if where == "checkout" else tmp_path,
            env=user_env(),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        for line in proc.stdout:
            if line.startswith("Press Ctrl-C"):
                break
        assert proc.poll() is None, f"up exited {proc.returncode}:\n{log.read_text()}"
        body = {"prompt": "def fibonacci(n):", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"http://127.0.0.1:{ports['http']}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected_answer
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text()
