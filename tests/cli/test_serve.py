"""`splitserve serve MODEL`: vLLM's flag names over `up`'s stack; `up --host`."""

import subprocess
import sys

import httpx
import pytest

from splitserve.cli import build_configs, main, parse_args
from splitserve.cli.placement import place
from splitserve.cli.serve import api_keys
from splitserve.cli.supervisor import banner, stack_commands
from splitserve.common.default_model_path import default_model_path
from tests.service_harness import free_port, wait_until

VLLM_FLAGS = [
    "serve",
    "/models/m",
    "--host",
    "0.0.0.0",
    "--port",
    "9000",
    "--api-key",
    "k1",
    "--api-key",
    "k2,k3",
    "k4",
    "--chat-template",
    "{{ messages[0].content }}",
    "--served-model-name",
    "mine",
    "--gpu-memory-utilization",
    "0.5",
    "--max-model-len",
    "512",
    "--enable-log-requests",
    "--api-server-count",
    "2",
]


def option(argv, flag):
    return argv[argv.index(flag) + 1]


def test_vllms_flags_parse_into_ups_configs():
    command, loaded, ns = parse_args(VLLM_FLAGS)
    configs = build_configs(loaded, ns)
    engine, up, gateway = configs["EngineConfig"], configs["UpConfig"], configs["UpGatewayConfig"]
    assert (engine.model, engine.kv_cache_memory_fraction, engine.max_model_len, engine.role) == (
        "/models/m",
        0.5,
        512,
        "both",
    )
    assert (up.host, up.http_port) == ("0.0.0.0", 9000)
    assert (gateway.chat_template, gateway.served_model_name, gateway.enable_log_requests) == (
        "{{ messages[0].content }}",
        "mine",
        True,
    )
    assert api_keys(ns) == ["k1", "k2", "k3", "k4"]
    commands = dict(stack_commands(engine, up, gateway))
    assert option(commands["gateway"], "--host") == "0.0.0.0"  # the public ports on every interface
    assert option(commands["gateway"], "--http-port") == "9000"
    assert option(commands["gateway"], "--chat-template") == "{{ messages[0].content }}"
    assert option(commands["gateway"], "--api-server-count") == "2"  # vLLM's flag, to the gateway
    assert "k1" not in " ".join(commands["gateway"])  # keys go by environment, never on a command line
    assert option(commands["prefill-0"], "--host") == option(commands["decode-0"], "--host") == "127.0.0.1"
    one_gpu = dict(stack_commands(engine, up, gateway, place(engine.device, engine.kv_cache_memory_fraction, up, 1)))
    assert option(one_gpu["prefill-0"], "--kv-cache-memory-fraction") == "0.25"  # 0.5 of the GPU, split in two
    assert "  OpenAI REST  http://127.0.0.1:9000/v1" in banner(up, "m").splitlines()  # reachable from here


def test_up_gains_host_and_keeps_its_own_names():
    command, loaded, ns = parse_args(["up", "--host", "::1", "--http-port", "8100", "--disable-log-requests"])
    configs = build_configs(loaded, ns)
    assert (configs["UpConfig"].host, configs["UpConfig"].http_port) == ("::1", 8100)
    assert configs["UpGatewayConfig"].enable_log_requests is False
    assert "  OpenAI REST  http://[::1]:8100/v1" in banner(configs["UpConfig"], "m").splitlines()


def test_the_model_given_twice_is_refused(capsys):
    assert main(["serve", "/a", "--model", "/b"]) == 2
    assert capsys.readouterr().err.endswith(
        "splitserve serve: error: the model is given twice: '/a' and --model '/b'\n"
    )


@pytest.mark.slow
def test_serve_answers_with_the_key_and_401s_without(tmp_path):
    ports = {name: free_port() for name in ("port", "grpc-port", "prefill-port", "decode-port", "metrics-ports")}
    argv = [sys.executable, "-m", "splitserve.cli", "serve", str(default_model_path()), "--api-key", "serve-key"]
    argv += [item for name, port in ports.items() for item in (f"--{name}", str(port))]
    argv += ["--num-kv-blocks", "128", "--block-size", "4", "--max-model-len", "256", "--stop-grace-s", "10"]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("Press Ctrl-C"):
                break
        assert lines[0].startswith("splitserve is up: model 'default_model'"), (tmp_path / "serve.log").read_text()
        base = f"http://127.0.0.1:{ports['port']}"
        body = {"model": "default_model", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
        assert httpx.post(base + "/v1/completions", json=body, timeout=30).status_code == 401
        ok = httpx.post(base + "/v1/completions", json=body, headers={"Authorization": "Bearer serve-key"}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(2)
        wait_until(lambda: proc.poll() is not None, 30, "serve to stop after Ctrl-C")
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_chat_template_reads_a_file_or_takes_a_template_and_names_the_flag_otherwise(tmp_path):
    from splitserve.gateway.server import read_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }} w40")
    assert read_chat_template(str(path)) == "{{ messages[0].content }} w40"
    assert read_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")
    assert read_chat_template("") is None
    with pytest.raises(ValueError) as info:
        read_chat_template(str(tmp_path / "missing.jinja"))
    missing = str(tmp_path / "missing.jinja")
    assert str(info.value) == f"--chat-template {missing!r} is neither a file nor a jinja template ({{{{ or {{% in it)"


def test_the_gateway_renders_every_chat_with_the_chat_template(tmp_path):
    from tests.gateway_fakes import FakeDecode, FakePrefill, Stack, make_tokenizer_dir

    stack = Stack(
        make_tokenizer_dir(str(tmp_path)),
        [FakePrefill()],
        [FakeDecode()],
        {"chat_template": "{{ messages[0].content }} w40"},
    ).start()
    try:
        chat = {"messages": [{"role": "user", "content": "hello w30"}]}
        plain = {"prompt": "hello w30 w40", "add_special_tokens": False}
        tokens = [httpx.post(stack.base_url + "/tokenize", json=b, timeout=10).json()["tokens"] for b in (chat, plain)]
        assert tokens[0] == tokens[1] and len(tokens[0]) == 3
    finally:
        stack.stop()
