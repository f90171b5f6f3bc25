"""`splitserve up --num-prefill N --num-decode M`: N prefills on consecutive ports, all given to the gateway
and to every decode; ports, metrics ports and memory shares counted for every prefill; a stack of 2 + 2 fake
services and the real gateway serving on both prefills."""

import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from splitserve.cli import parse_args
from splitserve.cli.supervisor import Placement, banner, check_ports, place, stack_commands
from splitserve.common.config import EngineConfig
from splitserve.gateway.config import UpConfig
from tests.gateway_fakes import make_tokenizer_dir
from tests.service_harness import wait_until

FAKES_PY = str(Path(__file__).parent.parent / "gateway_fakes.py")


def option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_every_prefill_gets_its_port_and_is_given_to_the_gateway_and_the_decodes():
    commands = dict(stack_commands(EngineConfig(), UpConfig(num_prefill=2, num_decode=2), num_cpus=8))
    assert list(commands) == ["prefill-0", "prefill-1", "decode-0", "decode-1", "gateway"]
    assert [option(commands[f"prefill-{i}"], "--port") for i in range(2)] == ["50061", "50062"]
    assert [option(commands[f"prefill-{i}"], "--instance-name") for i in range(2)] == ["prefill-0", "prefill-1"]
    assert [option(commands[f"prefill-{i}"], "--metrics-port") for i in range(2)] == ["9100", "9101"]
    assert [option(commands[f"decode-{i}"], "--metrics-port") for i in range(2)] == ["9102", "9103"]
    prefills, decodes = "127.0.0.1:50061,127.0.0.1:50062", "127.0.0.1:50071,127.0.0.1:50072"
    assert option(commands["gateway"], "--prefill") == prefills and option(commands["gateway"], "--decode") == decodes
    assert all(option(commands[f"decode-{i}"], "--prefill-peers") == prefills for i in range(2))
    assert all(option(commands[f"prefill-{i}"], "--decode-peers") == decodes for i in range(2))
    assert all(option(argv, "--num-threads") == "2" for name, argv in commands.items() if name != "gateway")
    for argv in commands.values():  # every flag is one the CLI accepts
        parse_args(argv[3:])


def test_prefills_share_their_gpu_and_their_ports_are_checked():
    one_gpu = place("auto", 0.9, UpConfig(num_prefill=2, num_decode=1), num_gpus=1)
    assert one_gpu == Placement("cuda:0", ("cuda:0",), "cuda_ipc", {"cuda:0": 0.3}, 2)
    two_gpus = place("auto", 0.8, UpConfig(num_prefill=2, num_decode=2), num_gpus=2)
    assert two_gpus == Placement("cuda:0", ("cuda:1", "cuda:1"), "cuda_ipc", {"cuda:0": 0.4, "cuda:1": 0.4}, 2)
    assert check_ports(UpConfig(num_prefill=11)) == (
        "prefill-10 (--prefill-port + 10) and decode-0 (--decode-port + 0) would both use port 50071; "
        "choose distinct ports"
    )
    assert check_ports(UpConfig(num_prefill=2, metrics_ports=65535)) == (
        "prefill-1 metrics (--metrics-ports + 1) would be port 65536, above 65535; lower its base port"
    )
    lines = banner(UpConfig(num_prefill=2, num_decode=2), "m").splitlines()
    assert lines[:5] == [
        "splitserve is up: model 'm', 2 prefill + 2 decode, KV over shm",
        "  prefill-0    cpu",
        "  prefill-1    cpu",
        "  decode-0     cpu",
        "  decode-1     cpu",
    ]
    assert (
        "  metrics      http://127.0.0.1:8000/metrics (gateway), http://127.0.0.1:9100/metrics (prefill-0), "
        "ports 9102.. (decodes)"
    ) in lines


# `up` with its engines replaced by fake services on the ports it gives them (the fake prefill prints a line per
# Prefill call, which `up` echoes prefixed with the child's name); the gateway is the real one. Its Describes come
# every 2 s: between two, the prompt tokens sent to a prefill count as its queued work, so back-to-back requests
# alternate between the prefills (every Describe answer resets that count to what the prefill reports: 0 here).
UP_SCRIPT = """
import sys
import splitserve.cli.supervisor as up
real = up.stack_commands
fake = [sys.executable, FAKES_PY]
def commands(engine, cfg, gateway_options=None, placement=None):
    out = real(engine, cfg, gateway_options, placement)
    engines = [(name, fake + [name.split("-")[0], argv[argv.index("--port") + 1], name]) for name, argv in out[:-1]]
    return engines + [("gateway", out[-1][1] + ["--health-interval-s", "2"])]
up.stack_commands = commands
from splitserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def free_run(n: int) -> int:
    """The first of `n` consecutive loopback ports free now."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + n > 65535:
            continue
        socks = []
        try:
            for port in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError(f"no {n} consecutive free ports")


@pytest.mark.slow
def test_up_with_two_prefills_and_two_decodes_serves_exact_tokens_on_both_prefills(tmp_path):
    tokenizer_dir = make_tokenizer_dir(str(tmp_path / "tokenizer"))
    prefill, decode, gateway = free_run(2), free_run(2), free_run(2)
    argv = [sys.executable, "-c", UP_SCRIPT.replace("FAKES_PY", repr(FAKES_PY)), "up", "--model", tokenizer_dir]
    argv += ["--num-prefill", "2", "--num-decode", "2", "--prefill-port", str(prefill), "--decode-port", str(decode)]
    argv += ["--grpc-port", str(gateway), "--http-port", str(gateway + 1), "--metrics-ports", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []  # the banner (stdout)
    echoed: list[str] = []  # the children's lines, prefixed with their names (stderr)
    for stream, into in ((proc.stdout, lines), (proc.stderr, echoed)):
        threading.Thread(target=lambda s=stream, i=into: i.extend(x.rstrip("\n") for x in s), daemon=True).start()
    try:
        wait_until(lambda: "Press Ctrl-C to stop." in lines, 60, lambda: f"the banner; up printed {lines}")
        assert lines[:5] == [
            "splitserve is up: model 'tiny-fake', 2 prefill + 2 decode, KV over shm",
            "  prefill-0    cpu",
            "  prefill-1    cpu",
            "  decode-0     cpu",
            "  decode-1     cpu",
        ]
        base = f"http://127.0.0.1:{gateway + 1}"

        def served_by(name: str) -> int:
            return sum(1 for line in echoed if line.startswith(f"{name:<9} | Prefill "))

        def one_request(i: int) -> bool:
            body = {"prompt": f"w{20 + i}", "max_tokens": 2}
            r = httpx.post(base + "/v1/completions", json=body, timeout=30)
            assert r.json()["choices"][0]["text"] == f" w{21 + i} w{22 + i}", r.text
            return True

        sent = []  # requests until each prefill has served one
        wait_until(
            lambda: sent.append(one_request(len(sent))) or (served_by("prefill-0") and served_by("prefill-1")),
            30,
            lambda: f"a Prefill on both prefills after {len(sent)} requests; up echoed {echoed[-40:]}",
            poll_s=0.0,
        )
        wait_until(lambda: served_by("prefill-0") + served_by("prefill-1") == len(sent), 10, "every Prefill echoed")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
