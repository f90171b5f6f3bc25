"""Start real splitserve service processes on loopback for integration tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """One `python -m engine.cli <command> ...` process; waits for its READY line."""

    def __init__(self, command: str, args: list[str], log_dir: Path, name: str) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "SPLITSERVE_LOG_LEVEL": "INFO"}
        self.log = open(self.log_path, "w")
        self.popen = subprocess.Popen([sys.executable, "-m", "engine.cli", command, *args], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.popen.stdout.readline()
            if line.startswith("READY"):
                return
            if not line and self.popen.poll() is not None:
                break
        raise RuntimeError(f"{self.name} did not become ready; log:\n{self.log_path.read_text()[-3000:]}")

    def kill(self, sig=signal.SIGKILL) -> None:
        """Signal the whole process group (the service and its engine core)."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        self.log.close()


def engine_args(model_dir: Path, **overrides) -> list[str]:
    values = {"model": str(model_dir), "dtype": "float64", "device": "cpu", "block-size": "4",
              "num-kv-blocks": "256", "num-threads": "1", "max-num-batched-tokens": "256"}
    values.update({k.replace("_", "-"): str(v) for k, v in overrides.items()})
    return [item for key, value in values.items() for item in (f"--{key}", value)]


def start_service(command: str, model_dir: Path, log_dir: Path, name: str, port: int | None = None,
                  service_args: list[str] = (), **engine_overrides) -> tuple[Proc, str]:
    port = port or free_port()
    args = engine_args(model_dir, **engine_overrides) + ["--port", str(port), "--instance-name", name, *service_args]
    proc = Proc(command, args, log_dir, name)
    return proc, f"127.0.0.1:{port}"
