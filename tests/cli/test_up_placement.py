"""`splitserve up`'s placement for 0, 1 and 2 visible GPUs (discovery faked) and the children it starts."""

import pytest

from splitserve.cli import supervisor as up
from splitserve.cli.placement import Placement, place
from splitserve.cli.supervisor import stack_commands
from splitserve.common.config import EngineConfig
from splitserve.gateway.config import UpConfig


def option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_no_gpu_places_everything_on_the_cpu_over_shm():
    assert place("auto", 0.9, UpConfig(num_decode=2), num_gpus=0) == Placement("cpu", ("cpu", "cpu"), "shm", {})
    assert place("cpu", 0.9, UpConfig(), num_gpus=2) == Placement("cpu", ("cpu",), "shm", {})


def test_one_gpu_is_shared_and_its_memory_split():
    assert place("auto", 0.9, UpConfig(), num_gpus=1) == Placement("cuda:0", ("cuda:0",), "cuda_ipc", {"cuda:0": 0.45})
    three = place("cuda", 0.9, UpConfig(num_decode=2), num_gpus=1)
    assert three == Placement("cuda:0", ("cuda:0", "cuda:0"), "cuda_ipc", {"cuda:0": 0.3})


def test_two_gpus_put_prefill_and_decodes_apart():
    assert place("auto", 0.9, UpConfig(), num_gpus=2) == Placement(
        "cuda:0", ("cuda:1",), "cuda_ipc", {"cuda:0": 0.9, "cuda:1": 0.9}
    )
    four = place("auto", 0.8, UpConfig(num_decode=3), num_gpus=3)
    assert four.decode_devices == ("cuda:1", "cuda:2", "cuda:1")
    assert four.memory_fraction == {"cuda:0": 0.8, "cuda:1": 0.4, "cuda:2": 0.8}


def test_explicit_devices_and_transport_win():
    p = place("auto", 0.9, UpConfig(prefill_device="cuda:1", decode_device="cuda:0", kv_transport="nccl"), num_gpus=2)
    assert p == Placement("cuda:1", ("cuda:0",), "nccl", {"cuda:1": 0.9, "cuda:0": 0.9})
    # a CPU prefill feeding a GPU decode: the pool is in host memory, so auto picks shm
    mixed = place("auto", 0.9, UpConfig(prefill_device="cpu"), num_gpus=1)
    assert mixed == Placement("cpu", ("cuda:0",), "shm", {"cuda:0": 0.9})
    listed = place("auto", 0.9, UpConfig(num_decode=2, decode_device="cuda:1,cuda:0"), num_gpus=2)
    assert listed.decode_devices == ("cuda:1", "cuda:0")


def test_nixl_runs_on_any_placement_and_is_refused_without_its_package(monkeypatch):
    from splitserve.common import nixl_package

    mixed = place("auto", 0.9, UpConfig(prefill_device="cpu", kv_transport="nixl"), num_gpus=1)
    assert mixed == Placement("cpu", ("cuda:0",), "nixl", {"cuda:0": 0.9})  # DRAM to VRAM: UCX moves it
    monkeypatch.setattr(nixl_package.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError) as info:
        place("auto", 0.9, UpConfig(kv_transport="nixl"), num_gpus=0)
    assert str(info.value) == (
        "--kv-transport nixl needs the NIXL package, which is not installed: install the extra "
        "(pip install 'splitserve-engine[nixl]', or scripts/install.sh VENV --dev from the lock)"
    )


@pytest.mark.parametrize(
    "device, config, num_gpus, message",
    [
        ("cuda", UpConfig(), 0, "--device cuda, but no CUDA device is visible; use --device cpu (or auto)"),
        ("cuda:1", UpConfig(), 1, "--device cuda:1, but 1 CUDA device(s) are visible"),
        (
            "auto",
            UpConfig(kv_transport="shm"),
            1,
            "--kv-transport shm needs the prefill's pool in host memory; the prefill runs on cuda:0",
        ),
        (
            "auto",
            UpConfig(kv_transport="cuda_ipc"),
            0,
            "--kv-transport cuda_ipc needs the prefill and every decode on CUDA devices",
        ),
        (
            "auto",
            UpConfig(kv_transport="nccl", prefill_device="cpu"),
            1,
            "--kv-transport nccl needs the prefill and the decodes all on CUDA or all on the CPU",
        ),
        (
            "auto",
            UpConfig(num_decode=3, decode_device="cuda:0,cuda:1"),
            2,
            "--decode-device lists 2 devices for 3 decodes: give one, or one per decode",
        ),
        (
            "auto",
            UpConfig(decode_device="cuda:2"),
            2,
            "--decode-device cuda:2: choose cpu or cuda:N with N < 2 (the CUDA devices visible)",
        ),
        (
            "auto",
            UpConfig(prefill_device="gpu"),
            1,
            "--prefill-device gpu: choose cpu or cuda:N with N < 1 (the CUDA devices visible)",
        ),
    ],
)
def test_placements_that_cannot_run_are_refused_naming_the_flag(device, config, num_gpus, message):
    with pytest.raises(ValueError) as info:
        place(device, 0.9, config, num_gpus)
    assert str(info.value) == message


def test_one_gpu_children_get_their_device_and_memory_share():
    engine = EngineConfig(kv_cache_memory_fraction=0.8, max_num_seqs=64)
    config = UpConfig(num_decode=1)
    commands = dict(stack_commands(engine, config, placement=place("auto", 0.8, config, num_gpus=1)))
    for name in ("prefill-0", "decode-0"):
        argv = commands[name]
        assert option(argv, "--device") == "cuda:0"
        assert option(argv, "--kv-cache-memory-fraction") == "0.4"
        assert option(argv, "--kv-transport") == "cuda_ipc"
        assert option(argv, "--max-num-seqs") == "64"  # other engine flags still go through
        assert argv.count("--device") == 1 and argv.count("--kv-cache-memory-fraction") == 1
    assert "--device" not in commands["gateway"]


def test_the_banner_says_where_each_process_runs():
    config = UpConfig(num_decode=2)
    lines = up.banner(config, "m", placement=place("auto", 0.9, config, num_gpus=2)).splitlines()
    assert lines[:4] == [
        "splitserve is up: model 'm', 1 prefill + 2 decode, KV over cuda_ipc",
        "  prefill-0    cuda:0 (memory fraction 0.9)",
        "  decode-0     cuda:1 (memory fraction 0.45)",
        "  decode-1     cuda:1 (memory fraction 0.45)",
    ]


def test_run_up_refuses_a_placement_before_starting_anything(monkeypatch, capsys):
    monkeypatch.setattr(up, "visible_gpus", lambda: 0)
    started = []
    monkeypatch.setattr(up.LocalStack, "add", lambda self, name, argv: started.append(name))
    code = up.run_up(None, {"EngineConfig": EngineConfig(device="cuda"), "UpConfig": UpConfig()})
    assert code == 2 and started == []
    assert capsys.readouterr().err == (
        "splitserve up: error: --device cuda, but no CUDA device is visible; use --device cpu (or auto)\n"
    )


def test_metrics_ports_reach_the_engines_and_the_banner():
    """Up --metrics-ports turns on the prefill's and decodes' /metrics."""
    config = UpConfig(num_decode=2, metrics_ports=9100)
    commands = dict(stack_commands(EngineConfig(), config))
    assert option(commands["prefill-0"], "--metrics-port") == "9100"
    assert [option(commands[f"decode-{i}"], "--metrics-port") for i in range(2)] == ["9101", "9102"]
    assert "--metrics-port" not in commands["gateway"]
    assert option(dict(stack_commands(EngineConfig(), UpConfig()))["prefill-0"], "--metrics-port") == "9100"
    assert "--metrics-port" not in dict(stack_commands(EngineConfig(), UpConfig(metrics_ports=0)))["prefill-0"]
    lines = up.banner(config, "m").splitlines()
    assert (
        "  metrics      http://127.0.0.1:8000/metrics (gateway), http://127.0.0.1:9100/metrics (prefill-0), "
        "ports 9101.. (decodes)"
    ) in lines
    assert up.check_ports(UpConfig(num_decode=2, metrics_ports=50070)) == (
        "decode-0 (--decode-port + 0) and decode-0 metrics (--metrics-ports + 1) would both use port 50071; "
        "choose distinct ports"
    )


def test_engines_on_the_cpu_share_the_cores():
    """Each CPU engine gets cores // CPU engines torch threads (at least 1): torch's default, every core in each
    process, left the OpenMP pools of the prefill and the decode waiting on each other on two cores."""
    commands = dict(stack_commands(EngineConfig(), UpConfig(num_decode=1), num_cpus=2))
    assert [option(commands[n], "--num-threads") for n in ("prefill-0", "decode-0")] == ["1", "1"]
    assert "--num-threads" not in commands["gateway"]
    four = dict(stack_commands(EngineConfig(), UpConfig(num_decode=3), num_cpus=16))
    assert [option(four[n], "--num-threads") for n in ("prefill-0", "decode-0", "decode-1", "decode-2")] == ["4"] * 4
    few = dict(stack_commands(EngineConfig(), UpConfig(num_decode=3), num_cpus=3))
    assert option(few["decode-2"], "--num-threads") == "1"


def test_a_given_num_threads_and_gpu_engines_are_left_alone():
    commands = dict(stack_commands(EngineConfig(num_threads=3), UpConfig(num_decode=1), num_cpus=2))
    for name in ("prefill-0", "decode-0"):
        assert option(commands[name], "--num-threads") == "3" and commands[name].count("--num-threads") == 1
    config = UpConfig(num_decode=1, prefill_device="cpu")
    mixed = dict(stack_commands(EngineConfig(), config, placement=place("auto", 0.9, config, num_gpus=1), num_cpus=8))
    assert option(mixed["prefill-0"], "--num-threads") == "8"  # the only engine on the CPU
    assert "--num-threads" not in mixed["decode-0"]
