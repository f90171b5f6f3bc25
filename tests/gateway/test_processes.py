"""The supervisor of `--api-server-count N` (gateway/processes.py), in this process: ports held for the gateway
processes, a taken port named, --max-connections divided among the processes."""

import socket

import pytest

from splitserve.gateway.config import GatewayConfig
from splitserve.gateway.processes import PortTaken, Supervisor, reserve_port, reuseport_listener


def bind_alone(port: int) -> None:
    """Bind 127.0.0.1:port without SO_REUSEPORT (as another program would); OSError when it is held."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_the_supervisor_holds_the_ports_and_divides_max_connections():
    config = GatewayConfig(grpc_port=0, http_port=0, api_server_count=3, max_connections=100)
    supervisor = Supervisor(config, target=print)
    children = supervisor._reserve()
    assert (children.max_connections, children.http_port, children.api_server_count) == (33, 0, 3)
    port = children.grpc_port
    assert port != 0
    with pytest.raises(OSError):
        bind_alone(port)  # another program cannot take it while the gateway runs
    listeners = [reuseport_listener("127.0.0.1", port) for _ in range(2)]  # the gateway processes can
    for listener in listeners:
        listener.close()
    supervisor._cleanup()
    bind_alone(port)  # free again once the supervisor is done


def test_a_port_another_program_listens_on_is_refused_naming_the_flag():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            PortTaken, match=rf"^--http-port {port} cannot be bound on 127.0.0.1: Address already in use"
        ):
            reserve_port("127.0.0.1", port, "--http-port")


def test_max_connections_never_falls_below_one_per_process():
    supervisor = Supervisor(GatewayConfig(grpc_port=0, http_port=0, api_server_count=4, max_connections=2), print)
    assert supervisor._reserve().max_connections == 1
    supervisor._cleanup()


def test_the_gateway_is_ready_once_every_process_has_a_full_path():
    supervisor = Supervisor(GatewayConfig(grpc_port=0, http_port=0, api_server_count=3), print)
    supervisor._reserve()
    shares = supervisor._shares()
    try:
        assert [s.processes_not_ready() for s in shares] == [[0, 1, 2]] * 3
        shares[0].mark_ready(True)
        shares[2].mark_ready(True)
        shares[2].mark_ready(True)  # told again after the next health round: no change
        assert [s.processes_not_ready() for s in shares] == [[1]] * 3
        shares[1].mark_ready(True)
        assert shares[0].processes_not_ready() == []
        shares[2].mark_ready(False)  # lost its decodes
        shares[2].mark_ready(False)
        assert shares[1].processes_not_ready() == [2]
    finally:
        supervisor._cleanup()
