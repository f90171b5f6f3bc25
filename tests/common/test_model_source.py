"""Models by Hugging Face id, resolved through a hub cache laid out on disk (tests/hub_cache.py; no network)."""

import os
import subprocess
import sys

import httpx
import pytest

from splitserve.cli import SUBCOMMANDS, build_configs, build_parser, main, resolve_models
from splitserve.cli.supervisor import stack_commands
from splitserve.common.config_fields import ConfigError
from splitserve.common.default_model_path import default_model_path
from splitserve.common.model_source import hub_cache_dir, resolve_model
from splitserve.gateway.config import UpConfig
from tests.hub_cache import COMMIT, add_snapshot
from tests.service_harness import free_port, wait_until

REPO = "acme/tiny-llama"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"
ENGINE_COMMANDS = ("up", "serve", "prefill", "decode", "worker", "generate")


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """HF_HOME with REPO at COMMIT (main) and at OTHER (branch v2), offline: the hub cache's directory."""
    cache = tmp_path / "hf" / "hub"
    add_snapshot(cache, REPO)
    add_snapshot(cache, REPO, commit=OTHER, refs=("v2",))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def snapshot(cache, commit=COMMIT):
    return str(cache / "models--acme--tiny-llama" / "snapshots" / commit)


def test_an_id_resolves_to_its_snapshot_and_a_revision_picks_another(hub):
    assert hub_cache_dir() == str(hub)
    source = resolve_model(REPO)
    assert (source.path, source.hub_id, source.revision) == (snapshot(hub), REPO, None)
    assert sorted(os.listdir(source.path)) == sorted(os.listdir(default_model_path()))
    assert resolve_model(REPO, "v2").path == snapshot(hub, OTHER)
    assert resolve_model(REPO, OTHER).path == snapshot(hub, OTHER)  # a commit, no ref needed


def test_hf_hub_cache_wins_over_hf_home(hub, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    add_snapshot(elsewhere, REPO, commit=OTHER)
    monkeypatch.setenv("HF_HUB_CACHE", str(elsewhere))
    assert resolve_model(REPO).path == str(elsewhere / "models--acme--tiny-llama" / "snapshots" / OTHER)


def test_a_local_path_is_used_as_given_and_ignores_the_revision(hub):
    path = str(default_model_path())
    assert resolve_model(path, "v2").path == path and resolve_model(path).hub_id is None


def test_offline_misses_name_the_id_the_revision_and_the_cache(hub):
    with pytest.raises(ConfigError) as info:
        resolve_model("acme/absent")
    assert str(info.value) == (
        f"--model 'acme/absent' revision 'main' is not in the Hugging Face cache {hub} (HF_HUB_OFFLINE is set, so "
        "nothing is downloaded); download it where the network reaches (`hf download acme/absent`), or point "
        "HF_HUB_CACHE / HF_HOME at a cache that holds it"
    )
    with pytest.raises(ConfigError) as info:
        resolve_model(REPO, "v9")
    assert str(info.value).startswith(
        f"--model '{REPO}' revision 'v9' is not in the Hugging Face cache {hub} (HF_HUB_OFFLINE is set"
    )
    assert "`hf download acme/tiny-llama --revision v9`" in str(info.value)


def test_what_is_neither_a_path_nor_an_id_is_named(hub):
    with pytest.raises(ConfigError) as info:
        resolve_model("./no/such/dir")
    assert str(info.value) == (
        "--model './no/such/dir' is neither an existing directory or file nor a Hugging Face model id (org/name)"
    )


def test_a_snapshot_without_config_json_is_refused(hub, tmp_path):
    files = tmp_path / "only-tokenizer"
    files.mkdir()
    (files / "tokenizer.json").write_bytes((default_model_path() / "tokenizer.json").read_bytes())
    add_snapshot(hub, "acme/no-config", files)
    with pytest.raises(ConfigError, match=r"the snapshot .* has no config.json; it is not a model"):
        resolve_model("acme/no-config")


def _configs(command, *flags):

    loaded = SUBCOMMANDS[command][1]()
    return resolve_models(build_configs(loaded, build_parser(command, loaded).parse_args(list(flags))))


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_every_engine_subcommand_resolves_an_id_and_serves_it_under_that_id(hub, command):
    engine = _configs(command, "--model", REPO, "--revision", "v2")["EngineConfig"]
    assert (engine.model, engine.model_id, engine.revision) == (snapshot(hub, OTHER), REPO, "v2")
    named = _configs(command, "--model", REPO, "--model-id", "mine")["EngineConfig"]
    assert (named.model, named.model_id) == (snapshot(hub), "mine")


def test_the_gateway_resolves_its_tokenizer_directory_and_keeps_the_engines_id(hub):
    gateway = _configs("gateway", "--model", REPO)["GatewayConfig"]
    assert (gateway.model, gateway.model_id) == (snapshot(hub), "")


def test_every_subcommand_that_takes_a_model_is_covered():
    takes_model = set()
    for command, (_, load) in SUBCOMMANDS.items():
        loaded = load()
        if any("model" in getattr(cls, "__dataclass_fields__", {}) for cls in loaded.config_classes):
            takes_model.add(command)
    assert takes_model == {*ENGINE_COMMANDS, "gateway"}


def test_up_hands_its_children_the_directory_and_the_id(hub):
    engine = _configs("up", "--model", REPO)["EngineConfig"]
    commands = dict(stack_commands(engine, UpConfig()))
    for name in ("prefill-0", "decode-0"):
        argv = commands[name]
        assert argv[argv.index("--model") + 1] == snapshot(hub)
        assert argv[argv.index("--model-id") + 1] == REPO
    gateway = commands["gateway"]
    assert gateway[gateway.index("--model") + 1] == snapshot(hub)


@pytest.mark.parametrize("command", ["gateway", "generate"])
def test_an_id_missing_offline_stops_the_command_before_it_starts(hub, command, capsys):
    assert main([command, "--model", "acme/absent", "--revision", "r1"]) == 2
    assert capsys.readouterr().err.startswith(
        f"splitserve {command}: error: --model 'acme/absent' revision 'r1' is not in the Hugging Face cache {hub}"
    )


def test_the_offline_llm_loads_an_id_and_answers_as_the_directory_does(hub):
    from splitserve.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    by_id = LLM(REPO, dtype="float32", device="cpu", num_kv_blocks=64)
    by_dir = LLM(str(default_model_path()), dtype="float32", device="cpu", num_kv_blocks=64)
    assert by_id.engine.info.model_id == REPO and by_dir.engine.info.model_id == "default_model"
    [a], [b] = by_id.generate(["def fibonacci(n):"], params), by_dir.generate(["def fibonacci(n):"], params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8


@pytest.mark.slow
def test_up_serves_a_hub_id_offline_under_that_id(hub, tmp_path):
    """`splitserve up --model org/name` with HF_HOME and HF_HUB_OFFLINE: the real stack answers under the id
    with the tokens the directory gives."""
    from splitserve.engine import LLM, SamplingParams

    ports = {name: free_port() for name in ("prefill", "decode", "grpc", "http")}
    argv = [sys.executable, "-m", "splitserve.cli", "up", "--model", REPO, "--device", "cpu", "--num-kv-blocks", "128"]
    for name, port in ports.items():
        argv += [f"--{name}-port", str(port)]
    argv += ["--served-model-name", f"{REPO},alias"]
    log = open(tmp_path / "up.log", "w")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=dict(os.environ))
    base = f"http://127.0.0.1:{ports['http']}"
    try:
        banner = next((line for line in proc.stdout if line.startswith("splitserve is up")), "")  # ends at exit
        assert banner.startswith(f"splitserve is up: model '{REPO}'"), (tmp_path / "up.log").read_text()[-3000:]
        models = httpx.get(base + "/v1/models", timeout=10).json()["data"]
        assert [(m["id"], m["root"]) for m in models] == [(REPO, REPO), ("alias", REPO)]
        body = {"model": "alias", "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
        assert answer["model"] == REPO  # the first served name, as vLLM reports it
        llm = LLM(str(default_model_path()), dtype="float32", device="cpu", num_kv_blocks=64)
        expected = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert answer["choices"][0]["text"] == expected[0].text
    finally:
        proc.send_signal(2)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    wait_until(lambda: proc.poll() is not None, 5, "up did not exit")
