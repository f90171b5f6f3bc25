"""A service that cannot listen on its port exits at once with a clear error naming the flag and the address,
stopping the engine core it had started (it once raised, then waited forever on that core: a test's stack hung
for 10 minutes when a prefill and a gateway were handed the same port)."""

from __future__ import annotations

import socket

import pytest

from splitserve.common.default_model_path import default_model_path
from tests.service_harness import ENGINE, free_port, start_service

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("command", ["prefill", "decode"])
def test_a_port_in_use_exits_1_naming_the_flag_and_the_address(command, tmp_path):
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        proc, _ = start_service(
            command,
            default_model_path(),
            tmp_path,
            command,
            port=port,
            service_args=["--kv-transport", "shm"],
            **ENGINE,
        )
        try:
            code = proc.popen.wait(120)
        finally:
            proc.kill()
            proc.log.close()
    log = proc.log_path.read_text()
    assert code == 1, f"{command} exited {code}; log:\n{log[-2000:]}"
    assert f"splitserve {command}: error: {command}" in log
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}: the address is in use or not available" in log
    assert "Traceback" not in log
