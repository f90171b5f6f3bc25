"""Start real splitserve service processes on loopback for integration tests."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def wait_until(condition, timeout_s: float, message: str | object, poll_s: float = 0.02):
    """Poll `condition()` until it returns a truthy value (returned), failing after `timeout_s` with
    `message` (a callable is called for the message, e.g. to read a log only on failure)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout_s:g} s: {message() if callable(message) else message}")
        time.sleep(poll_s)


async def wait_until_async(condition, timeout_s: float, message: str | object, poll_s: float = 0.05):
    """`wait_until` inside an event loop: awaits `condition()` (a coroutine function, e.g. one asking
    Describe) until it returns a truthy value (returned), failing after `timeout_s` with `message`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout_s:g} s: {message() if callable(message) else message}")
        await asyncio.sleep(poll_s)


def fault_env(faults: str) -> dict[str, str]:
    """Environment that makes a service process (and its engine core, which inherits it) load
    tests/fault_injection.py through tests/faults/sitecustomize.py (that folder holds only it)."""
    return {"SPLITSERVE_TEST_FAULTS": faults, "PYTHONPATH": str(REPO / "tests" / "faults")}


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port free now and not handed out before by this process: a service started on an earlier one
    may not have bound it yet (a slow prefill and a fast gateway once got the same port, and the prefill could not
    listen)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


class PortTaken(RuntimeError):
    """A service exited because its port was taken between `free_port` and its bind: another process's
    OS-chosen port (an outgoing connection, a server on port 0) can land on a port handed out but not yet
    bound. A caller that picked the ports starts again on fresh ones."""


_PORT_ERRORS = ("cannot listen on", "could not start on", "address already in use")


class Proc:
    """One `python -m splitserve.cli <command> ...` process; waits for its READY line."""

    def __init__(self, command: str, args: list[str], log_dir: Path, name: str, faults: str = "") -> None:
        """`faults`: what tests/fault_injection.py injects into this process and its engine core
        (e.g. "pull_drop=2"); empty = none."""
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SPLITSERVE_LOG_LEVEL": "INFO"}
        if faults:
            env.update(fault_env(faults))
        self.log = open(self.log_path, "w")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", command, *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.log,
            start_new_session=True,
        )
        self._stdout = b""  # what wait_ready has read of stdout and not used yet

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until the READY line; a process that exits first, or stays silent past `timeout_s`, fails with its log
        (stdout is read as it arrives, never blocking, so a hung start cannot hold the test past the bound)."""
        wait_all_ready([self], timeout_s)

    def _took_ready_line(self) -> bool:
        """Whether what was read of stdout holds the READY line (consumed with the lines before it)."""
        while b"\n" in self._stdout:
            line, self._stdout = self._stdout.split(b"\n", 1)
            if line.startswith(b"READY"):
                return True
        return False

    def _read_stdout(self) -> bool:
        """Read what stdout holds (select said it is readable); False at its end: the process exited."""
        chunk = os.read(self.popen.stdout.fileno(), 65536)
        if not chunk:
            self.popen.wait(10)
            return False
        self._stdout += chunk
        return True

    def start_failure(self, state: str) -> RuntimeError:
        """The error for a start that failed (`state` says how): `PortTaken` when the process exited naming a
        port it could not bind, else a RuntimeError with the log's tail."""
        log = self.log_path.read_text()
        taken = self.popen.poll() is not None and any(e in log.lower() for e in _PORT_ERRORS)
        error = PortTaken if taken else RuntimeError
        return error(f"{self.name} did not become ready ({state}); log:\n{log[-3000:]}")

    def kill(self, sig=signal.SIGKILL) -> None:
        """Signal the whole process group (the service and its engine core)."""
        self.signal(sig)
        self.reap()

    def signal(self, sig: int) -> None:
        """Send `sig` to the whole process group, if the service still runs."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def reap(self) -> None:
        """Wait for the exit (10 s, then SIGKILL to the group)."""
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        self.log.close()


def stop_all(procs) -> None:
    """`Proc.stop` for each of `procs`, their drains side by side: every one is sent SIGTERM before any is
    waited for (one after another, a stack's teardown took the sum of its services' drains)."""
    procs = list(procs)
    for proc in procs:
        proc.signal(signal.SIGTERM)
    for proc in procs:
        proc.stop()


def wait_all_ready(procs, timeout_s: float = 120.0, alive=()) -> None:
    """Until each of `procs` printed its READY line, while every one of `alive` (started, READY or not) keeps
    running. The first of either that exits fails at once with its log (`PortTaken` where it could not bind):
    a stack whose gateway lost its port is started again without waiting for its engines first. Each process
    has `timeout_s` after the one before it became ready (as when waited for one by one); silent longer, it
    fails alike."""
    deadline = time.monotonic() + timeout_s
    pending = [proc for proc in procs if not proc._took_ready_line()]
    watched = {proc.popen.stdout.fileno(): proc for proc in [*pending, *alive]}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise pending[0].start_failure(f"silent for {timeout_s:.0f} s")
        for fd in select.select(list(watched), [], [], min(1.0, remaining))[0]:
            proc = watched[fd]
            if not proc._read_stdout():
                raise proc.start_failure(f"exited {proc.popen.returncode}")
            if proc in pending and proc._took_ready_line():
                pending.remove(proc)
                del watched[fd]
                deadline = time.monotonic() + timeout_s


ENGINE = dict(dtype="float64", block_size=4, num_kv_blocks=512)


def engine_args(model_dir: Path, **overrides) -> list[str]:
    values = {
        "model": str(model_dir),
        "dtype": "float64",
        "device": "cpu",
        "block-size": "4",
        "num-kv-blocks": "256",
        "num-threads": "1",
        "max-num-batched-tokens": "256",
    }
    values.update({k.replace("_", "-"): str(v) for k, v in overrides.items()})
    return [item for key, value in values.items() for item in (f"--{key}", value)]


def start_service(
    command: str,
    model_dir: Path,
    log_dir: Path,
    name: str,
    port: int | None = None,
    service_args: list[str] = (),
    faults: str = "",
    **engine_overrides,
) -> tuple[Proc, str]:
    port = port or free_port()
    args = engine_args(model_dir, **engine_overrides) + ["--port", str(port), "--instance-name", name, *service_args]
    proc = Proc(command, args, log_dir, name, faults=faults)
    return proc, f"127.0.0.1:{port}"


def gateway_args(grpc_port: int | str, http_port: int | str, prefill: str, decode: str, *more: str) -> list[str]:
    """The flags of a `splitserve gateway` on these ports in front of `prefill` and `decode` (addresses,
    comma-separated), then `more`."""
    ports = ["--grpc-port", str(grpc_port), "--http-port", str(http_port)]
    return [*ports, "--prefill", prefill, "--decode", decode, *more]


def self_signed_cert(directory: Path, name: str) -> tuple[str, str]:
    """(certificate, key) paths of a new one-day self-signed P-256 certificate for localhost and
    127.0.0.1, written as `name`.crt / `name`.key in `directory`."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


class Stack:
    """gateway + prefill + N decodes on loopback, the default model, float64 (see ENGINE)."""

    def __init__(
        self,
        transport: str,
        logs,
        num_decode: int = 2,
        prefill_args: list[str] = (),
        decode_args: list[str] = (),
        prefill_faults: str = "",
        decode_faults: str = "",
        gateway_more: list[str] = (),
        num_prefill: int = 1,
        gateway_faults: str = "",
    ):
        """`num_prefill` > 1: prefills named prefill, prefill-1, ... (`prefills`), every one the gateway's and each
        decode's peer; `prefill` is the first."""
        from splitserve.common.default_model_path import default_model_path

        self.model, self.logs, self.transport = default_model_path(), logs, transport
        self.prefill_args = ["--kv-transport", transport, *prefill_args]
        self.prefill_faults = prefill_faults
        self.gateway_more = list(gateway_more)  # more gateway flags
        self.num_prefill = num_prefill
        self.gateway_faults = gateway_faults
        for attempt in range(3):
            self.procs: dict[str, Proc] = {}
            try:
                self._start(num_decode, decode_args, decode_faults)
                return
            except BaseException as exc:
                self.stop()  # no process outlives a failed start
                if not isinstance(exc, PortTaken) or attempt == 2:
                    raise

    def _start(self, num_decode: int, decode_args: list[str], decode_faults: str) -> None:
        model, logs, transport, prefill_faults = self.model, self.logs, self.transport, self.prefill_faults
        self.prefills = []
        for i in range(self.num_prefill):
            name = f"prefill-{i}" if i else "prefill"
            self.prefills.append(
                start_service(
                    "prefill", model, logs, name, service_args=self.prefill_args, faults=prefill_faults, **ENGINE
                )
            )
            self.procs[name] = self.prefills[-1][0]
        self.prefill = self.prefills[0]
        prefill_addresses = ",".join(address for _, address in self.prefills)
        self.decodes = []
        for i in range(num_decode):
            proc, addr = start_service(
                "decode",
                model,
                logs,
                f"decode-{i}",
                service_args=["--kv-transport", transport, "--prefill-peers", prefill_addresses, *decode_args],
                faults=decode_faults,
                **ENGINE,
            )
            self.procs[f"decode-{i}"] = proc
            self.decodes.append(addr)
        self.grpc_port, self.http_port = free_port(), free_port()
        self.gateway = Proc(
            "gateway",
            gateway_args(
                self.grpc_port,
                self.http_port,
                prefill_addresses,
                ",".join(self.decodes),
                "--health-interval-s",
                "0.2",
                *self.gateway_more,
            ),
            logs,
            "gateway",
            faults=self.gateway_faults,
        )
        self.procs["gateway"] = self.gateway
        wait_all_ready([proc for proc in self.procs.values() if proc is not self.gateway], alive=[self.gateway])
        self.wait_ready()

    def wait_ready(self, timeout_s=60.0):
        """Until the gateway's /ready answers 200 with every instance up; a gateway that exits first fails with
        its log (`PortTaken` where it could not bind)."""

        def ready() -> bool:
            try:
                r = httpx.get(f"http://127.0.0.1:{self.http_port}/ready", timeout=2)
                if r.status_code == 200 and all(i["up"] for i in r.json()["instances"]):
                    return True
            except httpx.HTTPError:
                pass
            gateway = self.procs["gateway"]  # the one running now (a test may have started another)
            if gateway.popen.poll() is not None:
                raise gateway.start_failure(f"exited {gateway.popen.returncode}")
            return False

        def log() -> str:
            return self.procs["gateway"].log_path.read_text()[-3000:]

        wait_until(ready, timeout_s, lambda: f"the gateway ready with every instance up; its log:\n{log()}", poll_s=0.2)

    def stop(self):
        stop_all(self.procs.values())

    def restart_prefill(self) -> None:
        """Start the prefill again on its old port (after a kill)."""
        port = int(self.prefill[1].rsplit(":", 1)[1])
        proc, _ = start_service(
            "prefill", self.model, self.logs, "prefill-restarted", port=port, service_args=self.prefill_args, **ENGINE
        )
        self.procs["prefill"] = proc
        proc.wait_ready()
