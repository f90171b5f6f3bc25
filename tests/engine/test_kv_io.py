"""The KV connectors' decode-side pool mappings: one per pool, a restarted prefill's new pool replaces the old; CUDA IPC
handles travel as plain data and are checked before anything of theirs runs; an NCCL receive lands exactly the
blocks sent and gives up after the transfer timeout."""

import base64
import os
import pickle
from types import SimpleNamespace

import pytest
import torch

from splitserve.common.kv_layout import KvLayout
from splitserve.engine.kv_connectors.base import Moved, PullTarget
from splitserve.engine.kv_connectors.block_copies import block_runs, copy_block_runs
from splitserve.engine.kv_connectors.factory import make_connector
from splitserve.engine.kv_connectors.ipc_handle import check_shape, load_cuda_ipc, plain_args
from splitserve.engine.kv_connectors.shm_pool import SharedKvPool, segment_name
from splitserve.engine.kv_connectors.shm_pool import copy_blocks as shm_copy_blocks
from splitserve.engine.worker.kv_cache import allocate_kv_cache
from tests.service_harness import wait_until

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32", model_id="kv-io-test")


def test_a_restarted_prefill_pool_replaces_its_old_mapping(monkeypatch):
    # owner and reader share this process: the reader must not drop the owner's resource-tracker entry
    monkeypatch.setattr("splitserve.engine.kv_connectors.shm_pool._untrack", lambda shm: None)
    pools = [SharedKvPool.create(segment_name("p-kvio", epoch), LAYOUT, 3) for epoch in (1, 2)]
    for value, pool in enumerate(pools, start=1):
        pool.tensor.fill_(value)
    io = make_connector({"transport": "shm", "instance": "d-kvio", "role": "decode"})
    try:
        endpoints = [{"shm_name": segment_name("p-kvio", epoch), "num_blocks": "3"} for epoch in (1, 2)]
        first = io.map_source("p-kvio", "shm", endpoints[0], LAYOUT)
        assert torch.equal(first, torch.full_like(first, 1.0))
        assert io.map_source("p-kvio", "shm", endpoints[0], LAYOUT).data_ptr() == first.data_ptr()  # mapped once
        second = io.map_source("p-kvio", "shm", endpoints[1], LAYOUT)  # the prefill restarted: new segment
        assert torch.equal(second, torch.full_like(second, 2.0))
        assert list(io._mapped) == [endpoints[1]["shm_name"]]  # the old mapping was closed and dropped
    finally:
        io.close()
        for pool in pools:
            pool.close()


def test_each_transport_has_one_connector_chosen_by_name():
    from splitserve.engine.kv_connectors.factory import TRANSPORTS

    chosen = {t: type(make_connector({"transport": t})).__name__ for t in TRANSPORTS}
    assert chosen == {
        "shm": "ShmConnector",
        "cuda_ipc": "CudaIpcConnector",
        "nccl": "NcclConnector",
        "nixl": "NixlConnector",
    }
    with pytest.raises(ValueError, match=r"^unknown KV transport 'rdma'; known: shm, cuda_ipc, nccl, nixl$"):
        make_connector({"transport": "rdma"})


def test_a_load_of_another_transport_starts_nothing():
    from splitserve.engine.kv_connectors.base import Load

    connector = make_connector({"transport": "shm", "role": "decode"})
    spec = SimpleNamespace(transport="nccl", prefill_instance="p0", block_ids=[3])
    load = Load("r1", spec, [0], [1], torch.zeros(LAYOUT.cache_shape(2)))
    with pytest.raises(ValueError, match=r"^the KV handle's transport is 'nccl'; this decode pulls over 'shm'$"):
        connector.start_load(load)
    assert connector.num_in_flight == 0 and connector.poll() == []
    with pytest.raises(ValueError, match=r"^the shm transport has no pairs; nccl pairs$"):
        connector.pair("p0->d", 0, "127.0.0.1", 1, "gloo", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^the shm transport sends nothing: its decodes read the prefill's pool$"):
        connector.send("p0->d", [1], torch.zeros(2))
    connector.close()


def numbered_pool(num_blocks: int) -> torch.Tensor:
    """A pool whose every element holds its block id (block-major, as the engine's pools are)."""
    pool = allocate_kv_cache(LAYOUT, num_blocks, "cpu")
    for b in range(num_blocks):
        pool[b].fill_(b)
    return pool


def test_block_runs_split_where_either_side_stops_advancing_by_one():
    assert block_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 2)]
    assert block_runs([4, 5, 6], [7, 8, 2]) == [(4, 7, 2), (6, 2, 1)]
    assert block_runs([], []) == []


@pytest.mark.parametrize(
    "src_ids",
    [[3, 4, 5, 6, 10, 11], list(range(0, 40, 2))],
    ids=["two runs", "20 runs"],
)
def test_copy_block_runs_moves_exactly_the_named_blocks_run_by_run_on_a_cpu(src_ids, monkeypatch):
    """On a CPU every run is one copy out of the pool (a memcpy): no staging gather, however many runs (a gather
    then scatter of 224 MiB in 64 blocks took 3.7x the per-run copies here)."""
    import splitserve.engine.kv_connectors.block_copies as copies

    calls = []
    monkeypatch.setattr(copies, "copy_blocks", lambda *args: calls.append(1) or shm_copy_blocks(*args))
    monkeypatch.setattr(copies, "copy_blocks_by_index", lambda *args: calls.append(2))
    src, dst = numbered_pool(48), torch.full(LAYOUT.cache_shape(24), -1.0)
    dst_ids = list(range(2, 2 + len(src_ids)))
    assert copy_block_runs(src, src_ids, dst, dst_ids) == len(src_ids) * LAYOUT.block_nbytes
    assert [int(dst[b].unique().item()) for b in range(24)] == [-1, -1, *src_ids, *[-1] * (22 - len(src_ids))]
    assert calls == []
    with pytest.raises(ValueError, match="copy_block_runs: 2 source blocks vs 1 destination blocks"):
        copy_block_runs(src, [0, 1], dst, [0])


def test_copy_block_runs_refuses_ids_outside_either_pool():
    src, dst = numbered_pool(4), torch.full(LAYOUT.cache_shape(4), -1.0)
    with pytest.raises(ValueError, match=r"copy_block_runs: source block ids 3\.\.5 outside the pool's 4 blocks"):
        copy_block_runs(src, [3, 4, 5], dst, [0, 1, 2])  # a slice src[3:6] would broadcast block 3
    with pytest.raises(ValueError, match=r"copy_block_runs: destination block ids -1\.\.0 outside the pool's 4 blocks"):
        copy_block_runs(src, [0, 1], dst, [-1, 0])
    assert (dst == -1).all()  # nothing was copied


def test_a_shm_pull_copies_the_handles_blocks_past_the_cached_prefix(monkeypatch):
    monkeypatch.setattr("splitserve.engine.kv_connectors.shm_pool._untrack", lambda shm: None)
    name = segment_name(f"p-pull-{os.getpid()}", 1)
    owner = SharedKvPool.create(name, LAYOUT, 16)
    owner.tensor.copy_(numbered_pool(16))
    io = make_connector({"transport": "shm", "instance": "d-pull", "role": "decode"})

    class Spec:  # the fields of a KvSpec a pull reads
        transport, prefill_instance, layout = "shm", "p-pull", LAYOUT
        endpoint = {"shm_name": name, "num_blocks": "16"}
        block_ids = [9, 10, 11, 12, 4]

    kv = torch.full(LAYOUT.cache_shape(8), -1.0)
    try:  # the first block is cached here already: blocks 1-4 of the handle go to 5, 6, 7 and 0
        target = PullTarget(kv, ask_send=None, source=io.prepare_pull(Spec))  # mapped on the core thread
        assert io.pull(Spec, [1, 2, 3, 4], [5, 6, 7, 0], target) == Moved(4 * LAYOUT.block_nbytes, 0)
        assert [int(kv[b].unique().item()) for b in range(8)] == [4, -1, -1, -1, -1, 10, 11, 12]
    finally:
        io.close()
        owner.close()


def test_only_segments_whose_owner_is_gone_are_stale(monkeypatch):
    """A prefill starting unlinks what earlier runs of its instance left, never the pool of a live process of the
    same name (test stacks run side by side on one host) nor another instance's whose name starts the same."""
    import subprocess
    import sys

    from splitserve.engine.kv_connectors.shm_pool import unlink_stale

    monkeypatch.setattr("splitserve.engine.kv_connectors.shm_pool._untrack", lambda shm: None)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    instance = f"p-stale-{os.getpid()}"
    names = [
        segment_name(instance, 1, pid=dead_pid),  # an earlier run's, its owner gone
        segment_name(instance, 2),  # this process's: alive
        segment_name(f"{instance}-2", 3, pid=dead_pid),  # instance "<instance>-2": not this instance's
    ]
    pools = [SharedKvPool.create(name, LAYOUT, 1) for name in names]
    try:
        assert unlink_stale(instance) == [names[0]]
        assert [os.path.exists(f"/dev/shm/{name}") for name in names] == [False, True, True]
    finally:
        for pool in pools:
            pool.close()


def test_a_mapped_pool_stays_mapped_while_a_copy_still_views_it(monkeypatch):
    """A worker's copy holds a view of the prefill's pool; closing the mapping (a restarted prefill's new pool
    replaced it, the process is shutting down) must not unmap it under that copy. The owner's name goes at once."""
    monkeypatch.setattr("splitserve.engine.kv_connectors.shm_pool._untrack", lambda shm: None)
    name = segment_name(f"p-view-{os.getpid()}", 1)
    owner = SharedKvPool.create(name, LAYOUT, 4)
    owner.tensor.fill_(7.0)
    reader = SharedKvPool.open(name, LAYOUT, 4)
    in_flight = reader.tensor[1:3]  # what a copy still reads
    reader.close()
    owner.close()
    assert not os.path.exists(f"/dev/shm/{name}")  # unlinked by its owner
    assert torch.equal(in_flight, torch.full_like(in_flight, 7.0))  # still mapped: reading it does not fault


def listening_addresses(port: int) -> list[str]:
    """Local addresses with a socket listening on `port` (from /proc/net/tcp and tcp6; state 0A = LISTEN)."""
    import ipaddress

    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                raw = bytes.fromhex(address)
                if width == 8:
                    found.append(str(ipaddress.IPv4Address(raw[::-1])))
                else:  # four little-endian 32-bit words
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    found.append(str(ipaddress.IPv6Address(words)))
    return sorted(found)


def test_a_gloo_receive_asks_for_its_send_lands_the_blocks_and_gives_up_when_none_comes():
    """The nccl transport on CPU (gloo), both ranks in this process: a pull asks for the send when its receive is
    about to start (the core's NeedSend), receives into staging and scatters; with no send it times out, drops
    the pair and leaves the destination blocks as they were."""
    import socket
    import threading
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    decode = make_connector({"transport": "nccl", "instance": "d", "timeout_s": 0.5})
    prefill = make_connector({"transport": "nccl", "instance": "p", "timeout_s": 0.5})
    cpu = torch.device("cpu")
    joining = threading.Thread(target=prefill.pair, args=("p->d", 1, "127.0.0.1", port, "gloo", cpu))
    joining.start()
    decode.pair("p->d", 0, "127.0.0.1", port, "gloo", cpu)
    joining.join(30)
    # the decode's store listens on the address it was given, not on every interface
    assert listening_addresses(port) == ["127.0.0.1"]
    src, dst = numbered_pool(8), torch.full(LAYOUT.cache_shape(8), -1.0)
    spec = SimpleNamespace(transport="nccl", prefill_instance="p", block_ids=[0, 6, 2, 5], tag=7, request_id="r1")
    asks, sent = [], []

    def ask_send(need):  # the service asks Prefill.SendKv; here the prefill's lane sends at once
        asks.append(need)
        ids = [spec.block_ids[i] for i in need.block_indices]
        threading.Thread(target=lambda: sent.append(prefill.send(need.pair, ids, src, tag=7))).start()

    try:
        assert decode.pull(spec, [1, 2, 3], [4, 1, 7], PullTarget(dst, ask_send)) == Moved(3 * LAYOUT.block_nbytes)
        assert [(a.request_id, a.pair, a.block_indices) for a in asks] == [("r1", "p->d", [1, 2, 3])]
        assert [int(dst[b].unique().item()) for b in range(8)] == [-1, 2, -1, -1, 6, -1, -1, 5]
        wait_until(lambda: sent, 10, "the prefill's send thread to return")
        assert sent[0]["num_bytes"] == 3 * LAYOUT.block_nbytes and sent[0]["device_ns"] == 0

        before = dst.clone()
        started = time.monotonic()
        unanswered = SimpleNamespace(**(spec.__dict__ | {"request_id": "r2"}))
        with pytest.raises(RuntimeError, match="[Tt]imed out"):  # nobody sends
            decode.pull(unanswered, [1], [0], PullTarget(dst, asks.append))
        assert 0.5 <= time.monotonic() - started < 3 and asks[-1].request_id == "r2"
        assert "p->d" not in decode.groups and torch.equal(dst, before)
    finally:
        decode.close()
        prefill.close()


SHAPE = (4, 2, 16)
# device, handle, storage size and offset, requires_grad, ref counter handle and offset, event handle and
# sync flag: the same in torch's arguments and in the plain fields (ipc_handle.FIELDS)
STORAGE = (0, b"c" + b"\x01" * 64, 256, 4096, False, b"/torch_123_4567_8", 8, b"\x02" * 64, True)
# what torch's reduce_tensor gives for a CUDA bfloat16 tensor (device, handles and sizes made up)
TORCH_ARGS = (torch.Tensor, torch.Size(SHAPE), (32, 16, 1), 0, torch.storage.TypedStorage, torch.bfloat16, *STORAGE)


def encode(value) -> str:
    return base64.b64encode(pickle.dumps(value)).decode()


def with_field(index: int, value) -> str:
    plain = list(plain_args(TORCH_ARGS))
    plain[index] = value
    return encode(tuple(plain))


def refusal(text: str) -> str:
    with pytest.raises(ValueError) as err:
        load_cuda_ipc(text)
    return str(err.value)


def test_a_cuda_ipc_handle_round_trips_as_plain_data():
    plain = plain_args(TORCH_ARGS)
    assert plain == (SHAPE, (32, 16, 1), 0, "bfloat16", *STORAGE)
    back = load_cuda_ipc(encode(plain))
    assert back == TORCH_ARGS and type(back[1]) is torch.Size
    with pytest.raises(ValueError) as err:
        plain_args((torch.nn.Parameter,) + TORCH_ARGS[1:])
    assert str(err.value) == "only plain tensors are exported over CUDA IPC, not Parameter on TypedStorage"


class _Touch:
    """Unpickling this would create a file: a handle that names code must be refused before it runs."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_a_handle_naming_code_or_malformed_is_refused_before_anything_runs(tmp_path):
    marker = tmp_path / "ran"
    assert refusal(encode(_Touch(marker))) == (
        "endpoint.cuda_ipc is not a CUDA IPC handle: a CUDA IPC handle holds plain data only, not io.open"
    )
    assert not marker.exists()
    plain = plain_args(TORCH_ARGS)
    assert refusal("not base64!") == "endpoint.cuda_ipc is not a CUDA IPC handle: not base64 text"
    assert refusal(base64.b64encode(pickle.dumps(plain)[:20]).decode()) == (
        "endpoint.cuda_ipc is not a CUDA IPC handle: pickle data was truncated"
    )
    assert refusal("A" * 20000) == "endpoint.cuda_ipc is not a CUDA IPC handle: over 16384 characters"
    assert refusal(encode(plain[:5])) == "endpoint.cuda_ipc must hold 13 fields, got 5"
    assert refusal(with_field(4, 1.5)) == "endpoint.cuda_ipc field device must be int, got 1.5"
    assert refusal(with_field(4, True)) == "endpoint.cuda_ipc field device must be int, got True"
    assert refusal(with_field(0, (4, "x"))) == "endpoint.cuda_ipc field size must be tuple, got (4, 'x')"
    assert refusal(with_field(5, None)) == "endpoint.cuda_ipc field handle must be bytes, got None"
    assert refusal(with_field(3, "_dynamo")) == "endpoint.cuda_ipc field dtype '_dynamo' is not a torch dtype"


def test_values_that_torch_would_trust_are_checked():
    """torch's native code uses these as they come: a file name in /dev/shm and a word in it to decrement,
    sizes and offsets that place the mapping. Each is held to what torch itself produces."""
    cases = {
        with_field(9, b"/etc/passwd"): "ref_counter_handle",
        with_field(9, b"/torch_1_2_3/../x"): "ref_counter_handle",
        with_field(10, 10000): "ref_counter_handle",
        with_field(10, -1): "ref_counter_handle",
        with_field(11, b"\x02" * 63): "event_handle",
        with_field(5, b""): "handle",
        with_field(5, b"x" * 5000): "handle",
        with_field(6, 255): "storage_size_bytes",  # the tensor needs 256 bytes
        with_field(0, (4, 2, 17)): "storage_size_bytes",
        with_field(2, -1): "offset",
        with_field(7, -4096): "offset",
        with_field(4, -1): "offset",
        with_field(0, (4, 0, 16)): "size",
        with_field(0, (1,) * 9): "size",
        with_field(1, (32, 16)): "size",
        with_field(8, True): "requires_grad",
    }
    for text, field in cases.items():
        message = refusal(text)
        assert message.startswith(f"endpoint.cuda_ipc field {field} "), message
        assert "out of range" in message
    assert refusal(with_field(10, 10000)) == (
        "endpoint.cuda_ipc field ref_counter_handle (b'/torch_123_4567_8', "
        "10000) is out of range: /torch_<pid>_<n>_<n> and a slot in [0, 10000)"
    )


def test_a_pool_handle_must_be_exactly_the_pool_its_layout_gives():
    args = load_cuda_ipc(encode(plain_args(TORCH_ARGS)))
    with pytest.raises(ValueError) as err:
        check_shape(args, (8, 2, 16), torch.bfloat16)
    assert str(err.value) == (
        "endpoint.cuda_ipc describes a torch.bfloat16 tensor of size (4, 2, 16) (stride (32, 16, 1), "
        "offset 0, 256 bytes), not the contiguous torch.bfloat16 pool of size (8, 2, 16) "
        "(512 bytes) its layout and num_blocks give"
    )
    with pytest.raises(ValueError) as err:
        check_shape(args, SHAPE, torch.float32)
    assert "not the contiguous torch.float32 pool of size (4, 2, 16) (512 bytes)" in str(err.value)
    with pytest.raises(ValueError) as err:  # the right pool, on a device this (CPU) process does not see
        check_shape(args, SHAPE, torch.bfloat16)
    assert str(err.value) == (
        f"endpoint.cuda_ipc field device 0 is out of range: this process sees {torch.cuda.device_count()} CUDA devices"
    )


OWNER = """
import sys, time, torch
from splitserve.engine.kv_connectors.ipc_handle import export_cuda_ipc
pool = torch.arange(4096, dtype=torch.float32, device="cuda").view(16, 256)
torch.cuda.synchronize()
print(export_cuda_ipc(pool), flush=True)
sys.stdin.readline()
"""


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_pool_exported_by_another_process_maps_here():
    import subprocess
    import sys

    from splitserve.engine.kv_connectors.ipc_handle import rebuild

    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        args = load_cuda_ipc(owner.stdout.readline().strip())
        check_shape(args, (16, 256), torch.float32)
        pool = rebuild(args)
        assert torch.equal(pool.cpu(), torch.arange(4096, dtype=torch.float32).view(16, 256))
        del pool
        torch.cuda.synchronize()
    finally:
        owner.communicate("done\n", timeout=60)


SENDER = r"""
import sys, torch
from splitserve.engine.kv_connectors.factory import make_connector
port = int(sys.argv[1])
io = make_connector({"transport": "nccl", "instance": "p", "timeout_s": 5})
pool = torch.arange(8 * 64, dtype=torch.float32, device="cuda:0").view(8, 2, 2, 4, 2, 2)
io.pair("p->d", 1, "127.0.0.1", port, "nccl", torch.device("cuda:0"))
for line in sys.stdin:
    if line.strip() != "send":
        break
    sent = io.send("p->d", [2, 3, 4], pool, tag=7)
    print(sent["num_bytes"], sent["device_ns"], flush=True)
"""


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL refuses two ranks on one)")
def test_an_nccl_receive_lands_the_blocks_and_times_out_when_nothing_is_sent():
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        io = make_connector({"transport": "nccl", "instance": "d", "timeout_s": 2})
        io.pair("p->d", 0, "127.0.0.1", port, "nccl", torch.device("cuda:1"))
        pool = torch.zeros(8, 2, 2, 4, 2, 2, device="cuda:1")
        asks = []

        def ask_send(need, tell_sender=True):  # called on this thread here; on a lane worker in a core
            asks.append(need)
            if tell_sender:
                sender.stdin.write("send\n")
                sender.stdin.flush()

        spec = SimpleNamespace(
            transport="nccl", prefill_instance="p", block_ids=[0, 0, 2, 3, 4], tag=7, request_id="r1"
        )
        target = PullTarget(pool, ask_send)
        assert io.pull(spec, [2, 3, 4], [5, 6, 7], target) == Moved(3 * 64 * 4)
        assert [(a.request_id, a.pair, a.block_indices) for a in asks] == [("r1", "p->d", [2, 3, 4])]
        expected = torch.arange(8 * 64, dtype=torch.float32).view(8, 2, 2, 4, 2, 2)[2:5]
        assert torch.equal(pool[5:8].cpu(), expected)  # in place when pull returned (its side stream synced)
        assert torch.count_nonzero(pool[:5]).item() == 0
        num_bytes, device_ns = map(int, sender.stdout.readline().split())
        assert num_bytes == 3 * 64 * 4 and device_ns > 0

        # nobody sends: the receive gives up after the transfer timeout and the pair is dropped
        target = PullTarget(pool, lambda need: ask_send(need, tell_sender=False))
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"did not finish within the transfer timeout \(2 s\)"):
            io.pull(SimpleNamespace(**(spec.__dict__ | {"request_id": "r2"})), [2, 3, 4], [5, 6, 7], target)
        assert 2.0 <= time.monotonic() - started < 4.0
        assert "p->d" not in io.groups
        torch.cuda.current_stream(torch.device("cuda:1")).synchronize()  # the abort let the stream go on
    finally:
        sender.stdin.close()
        sender.kill()
        sender.wait(timeout=30)


class FakeWork:
    """A send/receive as torch's NCCL work behaves: `wait()` only queues the stream's wait, `wait(timeout)`
    raises the error NCCL reported (if any) once `is_completed` has seen it."""

    def __init__(self, completes_after: int, error: Exception | None = None) -> None:
        self.polls, self.completes_after, self.error = 0, completes_after, error
        self.waits: list[object] = []

    def is_completed(self) -> bool:
        return self.error is not None or self.polls >= self.completes_after

    def wait(self, timeout=None) -> bool:
        self.waits.append(timeout)
        if self.error is not None and timeout is not None:
            raise self.error
        return True


class FakeEvent:
    """The event recorded behind the stream's wait: done once the work's kernels end (`ends_after` polls)."""

    def __init__(self, work: FakeWork, ends_after: int) -> None:
        self.work, self.ends_after = work, ends_after

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        self.work.polls += 1
        return self.work.polls > self.ends_after


class SimpleTensor:
    is_cuda = True
    device = "cuda:1"

    def numel(self) -> int:
        return 1024

    def element_size(self) -> int:
        return 2


def finish_with(monkeypatch, work: FakeWork, ends_after: int, timeout_s: float = 0.3):
    """NcclConnector._finish's CUDA path on this CPU: the CUDA event and stream are fakes driven by `work`."""
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: FakeEvent(work, ends_after))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    return make_connector({"transport": "nccl", "timeout_s": timeout_s})._finish(work, SimpleTensor())


def test_a_cuda_transfer_finishes_when_its_event_does(monkeypatch):
    import datetime

    work = FakeWork(completes_after=3)
    assert isinstance(finish_with(monkeypatch, work, ends_after=3), FakeEvent)
    assert work.polls == 4  # three polls of the event before it ends, one that sees it
    assert work.waits == [None, datetime.timedelta(seconds=0.3)]  # the stream's wait, then one check


def test_an_error_nccl_reports_raises_at_once_not_as_a_timeout(monkeypatch):
    import time

    work = FakeWork(completes_after=10**9, error=RuntimeError("NCCL error: remote process exited"))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="NCCL error: remote process exited"):
        finish_with(monkeypatch, work, ends_after=10**9, timeout_s=5.0)
    assert time.monotonic() - started < 1.0


def test_kernels_that_end_because_the_transfer_failed_are_no_finished_transfer(monkeypatch):
    # an aborted communicator ends its kernels, so the event completes; the work still carries the error
    work = FakeWork(completes_after=10**9, error=RuntimeError("NCCL communicator was aborted"))
    with pytest.raises(RuntimeError, match="NCCL communicator was aborted"):
        finish_with(monkeypatch, work, ends_after=0)


def test_a_cuda_transfer_that_never_ends_times_out(monkeypatch):
    import time

    started = time.monotonic()
    with pytest.raises(
        TimeoutError,
        match=r"^KV transfer of 2048 bytes did not finish within the transfer "
        r"timeout \(0\.3 s\)$",
    ):
        finish_with(monkeypatch, FakeWork(completes_after=10**9), ends_after=10**9)
    assert 0.3 <= time.monotonic() - started < 1.5


def test_a_failed_transfer_drops_its_own_communicator_never_its_replacement():
    io = make_connector({"transport": "nccl"})
    aborted = []
    old, new = (SimpleNamespace(abort=lambda name=name: aborted.append(name)) for name in ("old", "new"))
    io.groups["p->d"] = new  # a pairing replaced `old` while its transfer ran
    with pytest.raises(RuntimeError, match=r"^the communicator of pair p->d was replaced during the transfer$"):
        io._check_still_paired("p->d", old)
    io.drop_pair("p->d", old)
    assert io.groups["p->d"] is new and aborted == []
    io.drop_pair("p->d", new)
    assert "p->d" not in io.groups and aborted == ["new"]


def test_a_send_whose_communicator_a_pairing_replaced_fails_and_keeps_the_new_one():
    io = make_connector({"transport": "nccl", "timeout_s": 1})
    aborted = []
    new = SimpleNamespace(abort=lambda: aborted.append("new"))

    class Replaced:  # a pairing swaps in `new` while this group's send is in flight
        def abort(self):
            aborted.append("old")

        def send(self, tensors, dst, tag):
            return SimpleNamespace(wait=lambda timeout=None: io.groups.__setitem__("p->d", new))

    io.groups["p->d"] = Replaced()
    with pytest.raises(RuntimeError, match=r"^the communicator of pair p->d was replaced during the transfer$"):
        io.send("p->d", [1, 2], torch.zeros(4, 2))
    assert io.groups["p->d"] is new and aborted == []


def _rss_shmem_kib() -> int:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    return int(fields["RssShmem"].split()[0])


def test_a_shared_pool_takes_all_its_memory_when_created_not_as_blocks_are_first_used():
    """The prefill's memory grew over a long soak as fresh blocks of its sparse segment were first written (by up
    to the pool's size): the pool's pages are now mapped at creation, and using the blocks maps nothing more."""
    num_blocks = 128  # 256 KiB a block: 2 layers x (k, v) x 16 tokens x 2 heads x 512 dims x 4 bytes
    layout = KvLayout(num_layers=2, num_kv_heads=2, head_dim=512, block_size=16, dtype="float32", model_id="rss")
    nbytes = num_blocks * layout.block_nbytes
    assert nbytes == 32 << 20
    before = _rss_shmem_kib()
    pool = SharedKvPool.create(segment_name("p-rss", 1), layout, num_blocks)
    try:
        taken = _rss_shmem_kib() - before
        assert taken >= nbytes // 1024, f"{taken} KiB mapped of {nbytes // 1024}"
        pool.tensor.fill_(1.0)  # every block written, as a long run writes them
        assert _rss_shmem_kib() - before - taken < 1024  # nothing more than a page or so of noise
    finally:
        pool.close()
