"""A service that cannot listen on its port exits at once with a clear error naming the flag and the address,
stopping the engine core it had started (it once raised, then waited forever on that core: a test's stack hung
for 10 minutes when a prefill and a gateway were handed the same port)."""

from __future__ import annotations

import socket

import pytest

from splitserve.common.default_model_path import default_model_path
from tests.service_harness import ENGINE, free_port, start_service, stop_all

pytestmark = pytest.mark.slow


def test_a_port_in_use_exits_1_naming_the_flag_and_the_address(tmp_path):
    """A prefill and a decode, each given a port held open here; started side by side (each start is the work
    of one core, most of it before the bind)."""
    holders, ports, procs = {}, {}, {}
    try:
        for command in ("prefill", "decode"):
            holders[command] = socket.socket()
            holders[command].bind(("127.0.0.1", free_port()))
            holders[command].listen()
            ports[command] = holders[command].getsockname()[1]
            procs[command], _ = start_service(
                command,
                default_model_path(),
                tmp_path,
                command,
                port=ports[command],
                service_args=["--kv-transport", "shm"],
                **ENGINE,
            )
        codes = {command: proc.popen.wait(120) for command, proc in procs.items()}
    finally:
        stop_all(procs.values())
        for holder in holders.values():
            holder.close()
    for command, proc in procs.items():
        port, log = ports[command], proc.log_path.read_text()
        assert codes[command] == 1, f"{command} exited {codes[command]}; log:\n{log[-2000:]}"
        assert f"splitserve {command}: error: {command}" in log
        assert f"--port {port}: cannot listen on 127.0.0.1:{port}: the address is in use or not available" in log
        assert "Traceback" not in log, log


@pytest.mark.parametrize("taken", ["decode", "gateway"])
def test_a_stack_whose_port_is_taken_before_the_bind_starts_again_on_fresh_ports(taken, tmp_path, monkeypatch):
    """The race CI hit: a port handed out by free_port is bound by someone else before the service binds it.
    The decode's port (a gRPC service) or the gateway's REST port (uvicorn) is taken on the first attempt;
    the stack starts again on fresh ports and serves."""
    from tests import service_harness

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        held = holder.getsockname()[1]
        handed = []
        # the ports a first attempt takes, in order: prefill, decode-0, gateway gRPC, gateway REST
        victim = {"decode": 1, "gateway": 3}[taken]

        def port_or_the_held_one():
            handed.append(free_port() if len(handed) != victim else held)
            return handed[-1]

        monkeypatch.setattr(service_harness, "free_port", port_or_the_held_one)
        starts = []
        real_start = service_harness.Stack._start

        def counted_start(self, *args):
            starts.append(len(handed))
            return real_start(self, *args)

        monkeypatch.setattr(service_harness.Stack, "_start", counted_start)
        stack = service_harness.Stack("shm", tmp_path, num_decode=1)
        try:
            assert starts == [0, 4], f"the stack started at port counts {starts}; handed {handed}"
            assert held not in handed[4:], "the second attempt got the taken port again"
            assert stack.decodes == [f"127.0.0.1:{handed[5]}"]
            assert stack.http_port == handed[7]
            assert all(proc.popen.poll() is None for proc in stack.procs.values())
        finally:
            stack.stop()
