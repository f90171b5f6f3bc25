"""The nixl connector: a decode READs exactly the named blocks of a prefill's pool registered in another process
(UCX on loopback: DRAM here, VRAM on a GPU), refuses endpoints and block ids it cannot read, and a READ from a
prefill that died fails, drops its agent and leaves the destination blocks as they were."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from splitserve.common import nixl_package
from splitserve.common.kv_layout import KvLayout
from splitserve.engine.kv_connectors.base import Moved, PullTarget
from splitserve.engine.kv_connectors.factory import make_connector

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32", model_id="kv-nixl-test")

# A prefill's connector in its own process: its pool holds, in every element of block b, b + 0.5; it prints its
# endpoint and waits for a line on stdin before it exits.
OWNER = r"""
import json, sys, torch
from splitserve.common.kv_layout import KvLayout
from splitserve.engine.kv_connectors.factory import make_connector
layout = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32", model_id="kv-nixl-test")
io = make_connector({"transport": "nixl", "instance": "p-nixl", "role": "prefill"})
pool = io.kv_cache_factory(layout, 8, torch.device(sys.argv[1]))
for b in range(8):
    pool[b].fill_(b + 0.5)
if pool.is_cuda:
    torch.cuda.synchronize()
print(json.dumps(io.endpoint), flush=True)
sys.stdin.readline()
io.close()
"""


def start_owner(device: str) -> tuple[subprocess.Popen, dict]:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, device], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    line = owner.stdout.readline()
    assert line, f"the prefill's process exited ({owner.wait(30)}) before printing its endpoint"
    return owner, json.loads(line)


def spec_of(endpoint: dict, block_ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(transport="nixl", prefill_instance="p-nixl", block_ids=block_ids, endpoint=endpoint)


def block_values(pool: torch.Tensor) -> list[float]:
    """Each block's one value (-1 where nothing landed); raises if a block holds two."""
    values = []
    for b in range(pool.shape[0]):
        unique = pool[b].unique()
        assert unique.numel() == 1, f"block {b} holds {unique.tolist()}"
        values.append(float(unique.item()))
    return values


DEVICES = [
    "cpu",
    pytest.param(
        "cuda:0",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_reads_land_exactly_the_named_blocks_and_a_dead_prefill_fails_the_next(device):
    """One prefill process for all of it (a process start costs seconds here): refusals, reads, the prefill killed."""
    owner, endpoint = start_owner(device)
    decode = make_connector({"transport": "nixl", "instance": "d-nixl", "role": "decode", "timeout_s": 5})
    try:
        assert endpoint["nixl_mem"] == ("VRAM" if device.startswith("cuda") else "DRAM")
        assert endpoint["num_blocks"] == "8" and endpoint["nixl_agent"].startswith("p-nixl-")
        dst = decode.kv_cache_factory(LAYOUT, 8, torch.device(device))
        dst.fill_(-1.0)
        assert decode.endpoint == {}  # a decode's pool is registered (the READ's target), not published
        refuse_what_it_cannot_read(decode, endpoint, PullTarget(dst, None))
        assert decode.map_source("p-nixl", "nixl", endpoint, LAYOUT) is None  # loaded and connected at start
        # blocks 6, 2, 5 into 4, 1, 7 (three runs), then 1, 2, 3 into 5, 6, 0 (runs 1-2 -> 5-6 and 3 -> 0)
        moved = decode.pull(spec_of(endpoint, [0, 6, 2, 5]), [1, 2, 3], [4, 1, 7], PullTarget(dst, None))
        assert moved == Moved(3 * LAYOUT.block_nbytes)
        moved = decode.pull(spec_of(endpoint, [1, 2, 3]), [0, 1, 2], [5, 6, 0], PullTarget(dst, None))
        assert moved == Moved(3 * LAYOUT.block_nbytes)
        assert block_values(dst.cpu()) == [3.5, 2.5, -1.0, -1.0, 6.5, 1.5, 2.5, 5.5]
        assert list(decode._remotes) == ["p-nixl"]  # its agent loaded once

        owner.kill()
        owner.wait(30)
        before = dst.clone()
        with pytest.raises(RuntimeError, match=r"^NIXL READ from p-nixl failed: "):
            decode.pull(spec_of(endpoint, [4, 7]), [0, 1], [2, 3], PullTarget(dst, None))
        assert decode._remotes == {}  # dropped: the next pull loads the prefill's agent again
        assert torch.equal(dst, before)
    finally:
        decode.close()
        if owner.poll() is None:
            owner.communicate("done\n", timeout=60)


def refuse_what_it_cannot_read(decode, endpoint: dict, target: PullTarget) -> None:
    """Block ids past the prefill's pool, an endpoint without its agent, a prefill that could not say, another
    transport's pool: each refused with its reason, nothing read, no agent loaded."""
    before = target.kv_cache.clone()
    with pytest.raises(ValueError, match=r"^block ids 2\.\.8 outside the prefill's 8 blocks$"):
        decode.pull(spec_of(endpoint, [2, 8]), [0, 1], [0, 1], target)
    partial = {k: v for k, v in endpoint.items() if k != "nixl_metadata"}
    with pytest.raises(ValueError, match=r"^p-nixl reports no NIXL pool \(endpoint lacks nixl_metadata\)$"):
        decode.pull(spec_of(partial, [1]), [0], [0], target)
    with pytest.raises(RuntimeError, match=r"^cannot ask 127\.0\.0\.1:1 for its KV pool: gone$"):
        decode.pull(spec_of({"error": "cannot ask 127.0.0.1:1 for its KV pool: gone"}, [1]), [0], [0], target)
    with pytest.raises(ValueError, match=r"^a shm pool cannot be read by the nixl transport$"):
        decode.map_source("p-nixl", "shm", endpoint, LAYOUT)
    assert torch.equal(target.kv_cache, before) and decode._remotes == {}


def test_nixl_is_refused_without_the_package_naming_the_extra(monkeypatch):
    from splitserve.common.config_fields import ConfigError
    from splitserve.engine_service.config import ServiceConfig

    assert nixl_package.nixl_missing() is None  # the dev set installs it
    monkeypatch.setattr(nixl_package.importlib.util, "find_spec", lambda name: None)
    message = (
        "--kv-transport nixl needs the NIXL package, which is not installed: install the extra "
        "(pip install 'splitserve-engine[nixl]', or scripts/install.sh VENV --dev from the lock)"
    )
    with pytest.raises(ConfigError) as err:
        ServiceConfig(kv_transport="nixl")
    assert str(err.value) == message
    ServiceConfig(kv_transport="shm")  # the others need nothing more


def test_a_pool_is_described_to_nixl_by_its_own_memory_kind_and_device():
    from splitserve.engine.kv_connectors.nixl import memory_kind

    assert memory_kind(torch.device("cuda", 3)) == ("VRAM", 3)
    assert memory_kind(torch.device("cuda", 0)) == ("VRAM", 0)
    assert memory_kind(torch.device("cpu")) == ("DRAM", 0)
    with pytest.raises(ValueError, match=r"^a NIXL pool needs its CUDA device index \(got cuda\): pass the tensor"):
        memory_kind(torch.device("cuda"))


def test_a_read_posts_one_descriptor_per_run_of_consecutive_blocks_on_both_sides():
    from splitserve.engine.kv_connectors.block_copies import block_runs
    from splitserve.engine.kv_connectors.nixl import read_descriptors

    # source blocks 4,5,6 then 9 into destination blocks 0,1,2 then 7: two runs, 1 KiB blocks
    local, remote = read_descriptors(block_runs([4, 5, 6, 9], [0, 1, 2, 7]), 1024, (0x10000, 1), (0x90000, 2))
    assert local == [(0x10000, 3072, 1), (0x10000 + 7 * 1024, 1024, 1)]
    assert remote == [(0x90000 + 4 * 1024, 3072, 2), (0x90000 + 9 * 1024, 1024, 2)]
    # a whole prompt in consecutive blocks on both sides is one descriptor, however many blocks
    local, remote = read_descriptors(block_runs(list(range(128)), list(range(5, 133))), 1024, (0, 0), (0, 0))
    assert local == [(5 * 1024, 128 * 1024, 0)] and remote == [(0, 128 * 1024, 0)]


def test_ucx_defaults_fill_only_what_the_deployment_left_unset():
    from splitserve.engine.kv_connectors.nixl import apply_ucx_defaults

    environ = {"PATH": "/bin"}
    assert apply_ucx_defaults(environ, vram=False) == {"UCX_MEM_EVENTS": "no"}
    assert apply_ucx_defaults(environ, vram=True) == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    assert environ == {"PATH": "/bin", "UCX_MEM_EVENTS": "no", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    environ = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto", "UCX_MEM_EVENTS": "yes"}
    assert apply_ucx_defaults(environ, vram=True) == {}
    assert environ == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto", "UCX_MEM_EVENTS": "yes"}
