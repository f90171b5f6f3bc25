"""`splitserve up`: the commands it runs, port checks, readiness waiting with a message that
names what is not up, and a full run (fake prefill/decode processes + the real gateway
process) that prints the banner, serves, and leaves nothing running after Ctrl-C."""

import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest

from splitserve.cli import parse_args
from splitserve.cli.local_stack import LocalStack, RestartPolicy
from splitserve.cli.supervisor import banner, check_ports, stack_commands, wait_ready
from splitserve.common.config import EngineConfig
from splitserve.engine.kv_connectors.factory import TRANSPORTS
from splitserve.gateway.config import KV_TRANSPORTS, UpConfig, UpGatewayConfig
from splitserve.protos import common_pb2, generation_pb2, generation_pb2_grpc
from tests.gateway_fakes import make_tokenizer_dir, word
from tests.service_harness import gateway_args, self_signed_cert, wait_until

CLI = [sys.executable, "-m", "splitserve.cli"]
# the fake services run from their file: nothing of the checkout goes on the children's path
FAKE = [sys.executable, str(Path(__file__).parent.parent / "gateway_fakes.py")]


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def port_is_closed(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tokenizer")))


def test_transports_match_the_engine():
    assert KV_TRANSPORTS == TRANSPORTS


def test_stack_commands_forward_non_default_engine_flags():
    engine = EngineConfig(block_size=8, num_kv_blocks=64, enforce_eager=True, role="prefill")
    commands = stack_commands(engine, UpConfig(num_decode=2), num_cpus=6)
    eflags = ["--block-size", "8", "--num-kv-blocks", "64", "--enforce-eager"]  # role is never forwarded

    def service(role, name, port):
        return CLI + [
            role,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--instance-name",
            name,
            "--kv-transport",
            "shm",
        ]

    peers = ["--prefill-peers", "127.0.0.1:50061"]  # decodes map the prefill's pool at start
    decodes = ["--decode-peers", "127.0.0.1:50071,127.0.0.1:50072"]  # the prefill pairs only with these
    # placed as on a machine without GPUs, the 6 cores shared by 3 engines (tests/test_up_placement.py has the rest)
    cpu = ["--device", "cpu"]
    threads = ["--num-threads", "2"]

    def metrics(port):  # on by default: the prefill on 9100, decode i on 9101 + i
        return ["--metrics-port", str(port)]

    assert commands == [
        ("prefill-0", service("prefill", "prefill-0", 50061) + decodes + cpu + metrics(9100) + threads + eflags),
        ("decode-0", service("decode", "decode-0", 50071) + peers + cpu + metrics(9101) + threads + eflags),
        ("decode-1", service("decode", "decode-1", 50072) + peers + cpu + metrics(9102) + threads + eflags),
        (
            "gateway",
            CLI
            + [
                "gateway",
                "--host",
                "127.0.0.1",
                "--grpc-port",
                "50051",
                "--http-port",
                "8000",
                "--prefill",
                "127.0.0.1:50061",
                "--decode",
                "127.0.0.1:50071,127.0.0.1:50072",
            ],
        ),
    ]
    for _, argv in commands:  # every flag is one the CLI accepts
        parse_args(argv[3:])


def test_nccl_decodes_pair_with_the_prefill_and_model_goes_to_the_gateway():
    engine = EngineConfig(model="/models/x", model_id="x")
    commands = dict(stack_commands(engine, UpConfig(kv_transport="nccl"), num_cpus=2))
    assert commands["decode-0"] == CLI + [
        "decode",
        "--host",
        "127.0.0.1",
        "--port",
        "50071",
        "--instance-name",
        "decode-0",
        "--kv-transport",
        "nccl",
        "--prefill-peers",
        "127.0.0.1:50061",
        "--device",
        "cpu",
        "--metrics-port",
        "9101",
        "--num-threads",
        "1",
        "--model",
        "/models/x",
        "--model-id",
        "x",
    ]
    assert commands["gateway"][-4:] == ["--model", "/models/x", "--model-id", "x"]


def test_served_model_name_labels_every_engines_metrics():
    """vLLM labels metrics with its first --served-model-name: `up` gives the name to the engines too (their
    metrics' model_name label), not only to the gateway."""
    commands = dict(stack_commands(EngineConfig(), UpConfig(), UpGatewayConfig(served_model_name="m,alias")))
    for name in ("prefill-0", "decode-0"):
        at = commands[name].index("--served-model-name")
        assert commands[name][at + 1] == "m,alias"
        parse_args(commands[name][3:])
    assert commands["gateway"][-2:] == ["--served-model-name", "m,alias"]


def test_gateway_options_go_to_the_gateway_only():
    options = UpGatewayConfig(api_keys_file="/etc/keys", tls_cert="/c.pem", tls_key="/k.pem", rate_limit_rps=5.0)
    commands = dict(stack_commands(EngineConfig(), UpConfig(), options))
    assert commands["gateway"][-8:] == [
        "--api-keys-file",
        "/etc/keys",
        "--tls-cert",
        "/c.pem",
        "--tls-key",
        "/k.pem",
        "--rate-limit-rps",
        "5.0",
    ]
    assert "--tls-cert" not in commands["prefill-0"] and "--api-keys-file" not in commands["decode-0"]
    assert dict(stack_commands(EngineConfig(), UpConfig(), UpGatewayConfig()))["gateway"] == commands["gateway"][:-8]
    parse_args(commands["gateway"][3:])
    assert "host" not in {f.name for f in dataclasses.fields(UpGatewayConfig)}  # up sets addresses and ports


def test_banner_with_tls_and_api_keys():
    options = UpGatewayConfig(tls_cert="/c.pem", tls_key="/k.pem")
    body = json.dumps({"model": "m", "prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0})
    assert banner(UpConfig(), "m", options, keys_required=True).splitlines() == [
        "splitserve is up: model 'm', 1 prefill + 1 decode, KV over shm",
        "  prefill-0    cpu",
        "  decode-0     cpu",
        "  OpenAI REST  https://127.0.0.1:8000/v1",
        "  gRPC         127.0.0.1:50051  (splitserve.v1.Generation, reflection on, TLS)",
        "  readiness    https://127.0.0.1:8000/ready",
        "  metrics      https://127.0.0.1:8000/metrics (gateway), http://127.0.0.1:9100/metrics (prefill-0), "
        "ports 9101.. (decodes)",
        "  traces       off (--otlp-traces-endpoint or OTEL_EXPORTER_OTLP_ENDPOINT turns them on)",
        "Try (SPLITSERVE_API_KEY: one of the configured API keys):",
        "  curl -s --cacert /c.pem https://127.0.0.1:8000/v1/completions "
        '-H "Authorization: Bearer $SPLITSERVE_API_KEY"'
        f" -H 'Content-Type: application/json' -d '{body}'",
        "Press Ctrl-C to stop.",
    ]


@pytest.mark.slow
def test_an_unreadable_keys_file_stops_up_before_anything_starts(tmp_path):
    missing = tmp_path / "nope"
    proc = subprocess.run(CLI + ["up", "--api-keys-file", str(missing)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"splitserve up: error: --api-keys-file '{missing}' cannot be read: [Errno 2] No such file or directory"
        )
    )


def test_port_collisions_are_named():
    assert check_ports(UpConfig()) is None
    assert check_ports(UpConfig(decode_port=50050, num_decode=2)) == (
        "gateway --grpc-port and decode-1 (--decode-port + 1) would both use port 50051; choose distinct ports"
    )


DYING_CHILD = "\n".join(
    [
        "import sys",
        "print('loading', flush=True)",
        "for i in range(50):",
        "    print('line', i, file=sys.stderr)",
        "sys.exit(3)",
    ]
)


@pytest.mark.slow
def test_a_child_that_exits_early_is_reported_with_its_last_lines(tmp_path):
    stack = LocalStack(die_with_parent=False, log_dir=str(tmp_path), tail_lines=4)
    stack.add("decode-0", [sys.executable, "-c", DYING_CHILD])
    try:
        assert wait_ready("http://127.0.0.1:9", stack, timeout_s=10) == (
            "decode-0 exited with code 3 before the stack was ready"
        )
    finally:
        stack.stop(1.0)
    assert stack.failure_report("decode-0", 3).splitlines() == [
        f"decode-0 exited with code 3; its last 4 lines (all of them: {tmp_path / 'decode-0.log'}):",
        "decode-0  | line 46",
        "decode-0  | line 47",
        "decode-0  | line 48",
        "decode-0  | line 49",
    ]
    assert (tmp_path / "decode-0.log").read_text().splitlines()[:2] == ["loading", "line 0"]


@pytest.mark.slow
def test_up_reports_a_child_that_dies_before_ready_in_one_block(tokenizer_dir, tmp_path):
    """Only the dead child's lines reach the terminal, as one block after the reason; the others stay in their logs."""
    script = UP_SCRIPT.replace("FAKES_PY", repr(FAKE[1])).replace(
        '("decode-0", fake + ["decode", str(cfg.decode_port), "decode-0"])',
        f'("decode-0", [sys.executable, "-c", {DYING_CHILD!r}])',
    )
    ports = free_ports(4)
    argv = [sys.executable, "-c", script, "up", "--model", tokenizer_dir, "--stop-grace-s", "5"]
    for name, port in zip(("prefill", "decode", "grpc", "http"), ports):
        argv += [f"--{name}-port", str(port)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    start = lines.index("splitserve up: decode-0 exited with code 3 before the stack was ready")
    assert lines[start + 1].startswith("decode-0 exited with code 3; its last 40 lines (all of them: ")
    assert lines[start + 2 : start + 42] == [f"decode-0  | line {i}" for i in range(10, 50)]
    assert lines[start + 42] == "splitserve up: stopping (the gateway drains first, then the engines)"
    assert not [line for line in lines if line.startswith(("prefill-0 |", "gateway   |"))]


@pytest.mark.slow
def test_wait_ready_names_what_is_missing_then_the_stack_serves_and_stops(tokenizer_dir):
    prefill, decode, grpc_port, http_port = free_ports(4)
    base = f"http://127.0.0.1:{http_port}"
    stack = LocalStack(die_with_parent=False)
    stack.add("decode-0", FAKE + ["decode", str(decode), "decode-0"])
    flags = gateway_args(grpc_port, http_port, f"127.0.0.1:{prefill}", f"127.0.0.1:{decode}", "--model", tokenizer_dir)
    stack.add("gateway", CLI + ["gateway", *flags, "--health-interval-s", "0.1"])
    try:

        def gateway_serves_health():
            assert stack.first_exit() is None, f"{stack.first_exit()} exited before the gateway answered /live"
            try:
                return httpx.get(base + "/live", timeout=1).status_code == 200  # /health: 503 until ready
            except httpx.TransportError:
                return False

        wait_until(gateway_serves_health, 30, f"the gateway never answered {base}/live with 200", poll_s=0.1)
        message = wait_ready(base, stack, timeout_s=0.5)
        assert message.startswith(
            "not ready after 0.5 s: no prefill/decode pair with equal KV layouts and no "
            f"colocated worker is up; prefill at 127.0.0.1:{prefill}: Describe failed: UNAVAILABLE"
        )
        stack.add("prefill-0", FAKE + ["prefill", str(prefill), "prefill-0"])
        assert wait_ready(base, stack, timeout_s=20) is None
        r = httpx.post(base + "/v1/completions", json={"prompt": "w20", "max_tokens": 2}, timeout=10)
        assert r.json()["choices"][0]["text"] == " w21 w22"
    finally:
        codes = stack.stop(5.0)
    assert codes == {"decode-0": 0, "gateway": 0, "prefill-0": 0}
    assert all(port_is_closed(p) for p in (prefill, decode, grpc_port, http_port))


UP_SCRIPT = """
import sys
import splitserve.cli.supervisor as up
real = up.stack_commands
fake = [sys.executable, FAKES_PY]
up.stack_commands = lambda engine, cfg, gateway_options=None, placement=None: [
    ("prefill-0", fake + ["prefill", str(cfg.prefill_port), "prefill-0"]),
    ("decode-0", fake + ["decode", str(cfg.decode_port), "decode-0"]),
    ("gateway", real(engine, cfg, gateway_options)[-1][1] + ["--health-interval-s", "0.1"]),
]
from splitserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _start_up(tokenizer_dir, log_path, *flags):
    """`splitserve up` on fakes (UP_SCRIPT) with its stderr in `log_path` (None: dropped); (process, banner
    lines, ports by name: prefill, decode, grpc, http) once its banner is out."""
    ports = dict(zip(("prefill", "decode", "grpc", "http"), free_ports(4)))
    argv = [sys.executable, "-c", UP_SCRIPT.replace("FAKES_PY", repr(FAKE[1])), "up", "--model", tokenizer_dir]
    for name, port in ports.items():
        argv += [f"--{name}-port", str(port)]
    argv += ["--metrics-ports", "0"]  # the fakes serve no /metrics (the default, 9100, is tested without them)
    log = subprocess.DEVNULL if log_path is None else open(log_path, "w")
    proc = subprocess.Popen([*argv, *flags], stdout=subprocess.PIPE, stderr=log, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("Press Ctrl-C"):
                break
    except BaseException:
        proc.kill()
        raise
    return proc, lines, ports


@contextlib.contextmanager
def running_up(tokenizer_dir, *flags):
    """`splitserve up` (fake prefill/decode, real gateway) until its banner: yields (banner lines, grpc
    port, http port); on leaving, Ctrl-C must stop it with exit code 0 and every port must be closed."""
    proc, lines, ports = _start_up(tokenizer_dir, None, *flags)
    try:
        yield lines, ports["grpc"], ports["http"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert all(port_is_closed(p) for p in ports.values())


@pytest.mark.slow
def test_up_prints_the_banner_serves_and_leaves_nothing_after_ctrl_c(tokenizer_dir):
    with running_up(tokenizer_dir) as (lines, grpc_port, http_port):
        body = json.dumps({"model": "tiny-fake", "prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0})
        base = f"http://127.0.0.1:{http_port}"
        assert lines == [
            "splitserve is up: model 'tiny-fake', 1 prefill + 1 decode, KV over shm",
            "  prefill-0    cpu",
            "  decode-0     cpu",
            f"  OpenAI REST  {base}/v1",
            f"  gRPC         127.0.0.1:{grpc_port}  (splitserve.v1.Generation, reflection on)",
            f"  readiness    {base}/ready",
            "  traces       off (--otlp-traces-endpoint or OTEL_EXPORTER_OTLP_ENDPOINT turns them on)",
            "Try:",
            f"  curl -s {base}/v1/completions -H 'Content-Type: application/json' -d '{body}'",
            "Press Ctrl-C to stop.",
        ]
        r = httpx.post(base + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=10)
        # the prompt's words are unknown (<unk> = 2, skipped in text): the fakes continue 3, 4, ..., 34
        assert r.json()["choices"][0]["text"] == " ".join(word(i) for i in range(3, 35))


@pytest.mark.slow
def test_up_with_tls_and_api_keys_serves_only_authorized_https(tokenizer_dir, tmp_path):
    cert, key = self_signed_cert(tmp_path, "gw")
    keys = tmp_path / "keys"
    keys.write_text("# the up test's key\nup-test-key-1\n")
    flags = ["--tls-cert", str(cert), "--tls-key", str(key), "--api-keys-file", str(keys)]
    with running_up(tokenizer_dir, *flags) as (lines, _, http_port):
        base = f"https://127.0.0.1:{http_port}"
        assert (
            lines[0] == "splitserve is up: model 'tiny-fake', 1 prefill + 1 decode, KV over shm"
        )  # id asked with the key
        assert lines[3] == f"  OpenAI REST  {base}/v1"
        assert f"--cacert {cert} {base}/v1/completions" in lines[8]
        body = {"model": "tiny-fake", "prompt": "hello", "max_tokens": 2, "temperature": 0}
        ca = ssl.create_default_context(cafile=str(cert))
        assert httpx.post(base + "/v1/completions", json=body, verify=ca, timeout=10).status_code == 401
        ok = httpx.post(
            base + "/v1/completions",
            json=body,
            verify=ca,
            timeout=10,
            headers={"Authorization": "Bearer up-test-key-1"},
        )
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def _children(pid: int) -> dict[str, int]:
    """up's children by role word in their command line (prefill, decode, gateway) -> pid."""
    found = {}
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        for role in ("prefill", "decode", "gateway"):
            if f" {role} " in f" {cmdline} " and role not in found:
                found[role] = int(child)
    return found


@pytest.mark.slow
def test_sigterm_to_up_drains_the_gateway_first_so_every_stream_finishes(tokenizer_dir, tmp_path):
    """16 streams running when up gets SIGTERM all finish (the engines keep serving
    until the gateway has drained)."""
    import threading

    proc, _, ports = _start_up(tokenizer_dir, tmp_path / "up.log")
    try:
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}"))
        started, results = threading.Barrier(17), [None] * 16

        def run(i):
            stream = stub.Generate(
                generation_pb2.GenerateRequest(text="w20", sampling=common_pb2.SamplingParams(max_tokens=60)),
                timeout=60,
            )
            messages = [next(stream)]
            started.wait(30)
            messages += list(stream)
            results[i] = messages

        threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        started.wait(30)  # every stream has its first token
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    finishes = [(sum(len(m.token_ids) for m in r), r[-1].finish_reason) for r in results]
    assert finishes == [(60, common_pb2.FINISH_REASON_LENGTH)] * 16
    assert "the gateway drains first, then the engines" in (tmp_path / "up.log").read_text()


@pytest.mark.slow
def test_a_child_that_dies_is_restarted_and_the_stack_serves_again(tokenizer_dir, tmp_path):
    """Kill -9 of the decode: up restarts it (logged) instead of stopping everything."""
    proc, _, ports = _start_up(tokenizer_dir, tmp_path / "up.log")
    base = f"http://127.0.0.1:{ports['http']}"
    try:
        os.kill(_children(proc.pid)["decode"], signal.SIGKILL)
        log = tmp_path / "up.log"
        wait_until(
            lambda: (
                "decode-0 exited with code -9; restarting it in 0.5 s (restart 1 of --max-restarts 3 within "
                "--restart-window-s 60)" in log.read_text()
            ),
            10,
            lambda: "no restart logged:\n" + log.read_text(),
        )

        def serves() -> bool:
            try:
                return httpx.get(base + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(serves, 30, "the stack never served again after the restart")
        body = {"model": "tiny-fake", "prompt": "w20", "max_tokens": 3, "temperature": 0}
        assert (
            httpx.post(base + "/v1/completions", json=body, timeout=10).json()["choices"][0]["text"] == " w21 w22 w23"
        )
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_restarts_back_off_and_are_budgeted_over_a_sliding_window():
    policy = RestartPolicy(max_restarts=3, window_s=60.0, backoff_s=0.5)
    assert [policy.delay("decode-0", t) for t in (0.0, 1.0, 2.0)] == [0.5, 1.0, 2.0]  # doubling
    assert policy.count("decode-0") == 3
    assert policy.delay("decode-0", 3.0) is None  # a fourth exit inside the window: the budget is spent
    assert policy.delay("prefill-0", 3.0) == 0.5  # each child has its own
    assert policy.delay("decode-0", 60.5) == 2.0  # the exit at 0.0 left the window: this is the third in it
    assert policy.delay("decode-0", 1000.0) == 0.5  # a child that fails once in a while: every time
    busy = RestartPolicy(20, 600.0, 1.0)
    assert [busy.delay("x", t) for t in range(7)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]  # capped
    assert RestartPolicy(0, 60.0, 0.5).delay("x", 0.0) is None  # --max-restarts 0: never


@pytest.mark.slow
def test_a_crash_loop_stops_the_stack_reporting_the_childs_last_lines(tokenizer_dir, tmp_path):
    """The decode killed again after each of its two restarts: the third exit within the window stops up, with
    the decode's block (its last lines, kept across its restarts, and its log)."""
    log = tmp_path / "up.log"
    proc, _, _ = _start_up(tokenizer_dir, log, "--max-restarts", "2", "--restart-backoff-s", "0.1")
    try:
        for n, delay in ((1, "0.1"), (2, "0.2")):
            pid = _children(proc.pid)["decode"]
            os.kill(pid, signal.SIGKILL)
            wanted = (
                f"decode-0 exited with code -9; restarting it in {delay} s (restart {n} of --max-restarts 2 within "
                "--restart-window-s 60)"
            )
            wait_until(lambda: wanted in log.read_text(), 10, lambda: f"not logged: {wanted}\n" + log.read_text())
            wait_until(lambda: _children(proc.pid).get("decode", pid) != pid, 10, "the decode was not started again")
        os.kill(_children(proc.pid)["decode"], signal.SIGKILL)
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = log.read_text().splitlines()
    stop = lines.index(
        "splitserve up: decode-0 exited with code -9 after 2 restarts within --restart-window-s 60 "
        "(--max-restarts 2); stopping the stack"
    )
    # the fake decode prints nothing: its block is the header alone, naming the log that holds all it wrote
    assert re.fullmatch(
        r"decode-0 exited with code -9; its last 0 lines \(all of them: /\S+/decode-0\.log\):", lines[stop + 1]
    )
    assert lines[stop + 2] == "splitserve up: stopping (the gateway drains first, then the engines)"
