"""Start a whole stack on free loopback ports for one benchmark run, and stop it afterwards.

    disaggregated:  prefill ×P + decode ×D  ─┐
    colocated:      worker ×W (role both)   ─┴─▶ gateway (same code in both setups)

Children are `python -m splitserve.cli <command>` processes in sessions of their own, each logging
to <log_dir>/<name>.log; stopping sends SIGTERM to each process group (the service and its
engine core), then SIGKILL after a grace period.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
MODES = ("disaggregated", "colocated")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class LaunchPlan:
    """Shape of the stack: engine processes per role, engine flags shared by all, one device each."""

    mode: str
    engine_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()  # one per engine process, in start order; empty = the engine's default
    num_prefill: int = 1
    num_decode: int = 1
    num_workers: int = 2
    kv_transport: str = "shm"
    role_args: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (role, flags after engine_args) per role

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--launch must be one of {', '.join(MODES)}, got {self.mode!r}")
        if min(self.num_prefill, self.num_decode, self.num_workers) < 1:
            raise ValueError("--num-prefill, --num-decode and --num-workers must be >= 1")
        if self.devices and len(self.devices) != self.num_engines:
            raise ValueError(
                f"--devices lists {len(self.devices)} devices but {self.mode} starts "
                f"{self.num_engines} engine processes; give one device per process"
            )

    @property
    def num_engines(self) -> int:
        return self.num_prefill + self.num_decode if self.mode == "disaggregated" else self.num_workers

    @classmethod
    def from_strings(cls, mode: str, engine_args: str, gateway_args: str, devices: str, **counts) -> LaunchPlan:
        return cls(
            mode,
            tuple(shlex.split(engine_args)),
            tuple(shlex.split(gateway_args)),
            tuple(d.strip() for d in devices.split(",") if d.strip()),
            **counts,
        )


def _flag_value(args: tuple[str, ...], flag: str) -> str | None:
    """Value of `flag` in args (`--flag v` or `--flag=v`), the last one winning."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def launch_commands(
    plan: LaunchPlan, grpc_port: int, http_port: int, engine_ports: list[int]
) -> list[tuple[str, list[str]]]:
    """(name, argv) of every child in start order; the gateway last."""
    if len(engine_ports) != plan.num_engines:
        raise ValueError(f"need {plan.num_engines} engine ports, got {len(engine_ports)}")
    cli = [sys.executable, "-m", "splitserve.cli"]
    if plan.mode == "disaggregated":
        roles = ["prefill"] * plan.num_prefill + ["decode"] * plan.num_decode
        names = [f"prefill-{i}" for i in range(plan.num_prefill)] + [f"decode-{i}" for i in range(plan.num_decode)]
    else:
        roles, names = ["worker"] * plan.num_workers, [f"worker-{i}" for i in range(plan.num_workers)]
    addresses = [f"{HOST}:{port}" for port in engine_ports]
    prefills = [a for a, r in zip(addresses, roles) if r == "prefill"]
    commands = []
    for i, (role, name, port) in enumerate(zip(roles, names, engine_ports)):
        argv = cli + [role, "--host", HOST, "--port", str(port), "--instance-name", name, *plan.engine_args]
        argv += [flag for r, flags in plan.role_args if r == role for flag in flags]
        if role != "worker":
            argv += ["--kv-transport", plan.kv_transport]
        if role == "decode":
            argv += ["--prefill-peers", ",".join(prefills)]
        if plan.devices:
            argv += ["--device", plan.devices[i]]  # after engine_args: one device per process wins
        commands.append((name, argv))
    gateway = cli + [
        "gateway",
        "--host",
        HOST,
        "--grpc-port",
        str(grpc_port),
        "--http-port",
        str(http_port),
        "--prefill",
        ",".join(prefills),
        "--decode",
        ",".join(a for a, r in zip(addresses, roles) if r != "prefill"),
    ]
    for flag in ("--model", "--model-id"):
        value = _flag_value(plan.engine_args, flag)
        if value:
            gateway += [flag, value]
    return commands + [("gateway", gateway + list(plan.gateway_args))]


class LaunchedStack:
    """The stack's processes; `grpc_port`/`http_port` are the gateway's. Use as a context manager."""

    def __init__(
        self, plan: LaunchPlan, log_dir: str | None = None, ready_timeout_s: float = 300.0, stop_grace_s: float = 15.0
    ) -> None:
        self.plan, self.ready_timeout_s, self.stop_grace_s = plan, ready_timeout_s, stop_grace_s
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="splitserve-serve-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.grpc_port, self.http_port = free_port(), free_port()
        self.engine_ports = [free_port() for _ in range(plan.num_engines)]
        self.procs: dict[str, subprocess.Popen] = {}
        self.ready_s: float | None = None

    def __enter__(self) -> LaunchedStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Start every child and wait until the gateway reports every instance up."""
        # the children run the installed package: nothing of a checkout goes first on their path (a folder of
        # ours named like a library, `kernels`, would shadow it)
        env = {**os.environ, "PYTHONSAFEPATH": "1"}
        started = time.monotonic()
        for name, argv in launch_commands(self.plan, self.grpc_port, self.http_port, self.engine_ports):
            with open(self.log_dir / f"{name}.log", "w") as log:
                self.procs[name] = subprocess.Popen(
                    argv,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
        self._wait_ready()
        self.ready_s = time.monotonic() - started

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        last = "the gateway's REST port did not answer"
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with code {proc.returncode} before the stack was ready; "
                        f"{self.log_dir / (name + '.log')}:\n{self.log_tail(name)}"
                    )
            try:
                with urllib.request.urlopen(f"http://{HOST}:{self.http_port}/ready", timeout=2) as r:
                    status = json.loads(r.read())
                down = [i["address"] for i in status["instances"] if not i["up"]]
                if not down:
                    return
                last = f"instances not up yet: {', '.join(down)}"
            except urllib.error.HTTPError as exc:
                last = json.loads(exc.read() or b"{}").get("reason", f"HTTP {exc.code}")
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(
            f"the {self.plan.mode} stack was not ready after {self.ready_timeout_s:g} s: {last} "
            f"(logs in {self.log_dir})"
        )

    def log_tail(self, name: str, num_chars: int = 3000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""

    def stop(self) -> dict[str, int]:
        """SIGTERM every process group (gateway first), SIGKILL what remains after the grace; name -> code."""
        for proc in reversed(list(self.procs.values())):
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        for proc in self.procs.values():  # an engine core that outlived its service
            while _group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _group_alive(proc.pid):
                _signal_group(proc, signal.SIGKILL, even_if_exited=True)
        return {name: proc.returncode for name, proc in self.procs.items()}


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal_group(proc: subprocess.Popen, sig: int, even_if_exited: bool = False) -> None:
    """Signal the child's session (its engine core too); the child leads it (start_new_session)."""
    if proc.poll() is not None and not even_if_exited:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
