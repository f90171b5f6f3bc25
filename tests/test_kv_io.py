"""KvIo's decode-side pool mappings: one per pool, a restarted prefill's new pool replaces the old; CUDA IPC
handles travel as plain data and are checked before anything of theirs runs."""

import base64
import pickle

import pytest
import torch

from engine.kv_layout import KvLayout
from engine.kv_transfer.io import KvIo, ipc_plain_args, load_cuda_ipc
from engine.kv_transfer.shm import SharedKvPool, segment_name

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32", model_id="kv-io-test")


def test_a_restarted_prefill_pool_replaces_its_old_mapping(monkeypatch):
    # owner and reader share this process: the reader must not drop the owner's resource-tracker entry
    monkeypatch.setattr("engine.kv_transfer.shm._untrack", lambda shm: None)
    pools = [SharedKvPool.create(segment_name("p-kvio", epoch), LAYOUT, 3) for epoch in (1, 2)]
    for value, pool in enumerate(pools, start=1):
        pool.tensor.fill_(value)
    io = KvIo({"transport": "shm", "instance": "d-kvio", "role": "decode"})
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


# what torch's reduce_tensor gives for a CUDA bfloat16 tensor (device, handles and sizes made up)
TORCH_ARGS = (torch.Tensor, torch.Size([4, 2, 16]), (32, 16, 1), 64, torch.storage.TypedStorage, torch.bfloat16, 1,
              b"\x01" * 64, 1 << 20, 4096, False, b"ref", 8, b"\x02" * 64, True)


def encode(value) -> str:
    return base64.b64encode(pickle.dumps(value)).decode()


def test_a_cuda_ipc_handle_round_trips_as_plain_data():
    plain = ipc_plain_args(TORCH_ARGS)
    assert plain == ((4, 2, 16), (32, 16, 1), 64, "bfloat16", 1, b"\x01" * 64, 1 << 20, 4096, False, b"ref", 8,
                     b"\x02" * 64, True)
    back = load_cuda_ipc(encode(plain))
    assert back == TORCH_ARGS and type(back[1]) is torch.Size


class _Touch:
    """Unpickling this would create a file: a handle that names code must be refused before it runs."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_a_handle_naming_code_or_malformed_is_refused_before_anything_runs(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(ValueError) as err:
        load_cuda_ipc(encode(_Touch(marker)))
    assert str(err.value) == ("endpoint.cuda_ipc is not a CUDA IPC handle: a CUDA IPC handle holds plain data only, "
                              "not io.open")
    assert not marker.exists()
    plain = list(ipc_plain_args(TORCH_ARGS))
    cases = {
        "not base64!": "endpoint.cuda_ipc is not a CUDA IPC handle: not base64 text",
        base64.b64encode(pickle.dumps(tuple(plain))[:20]).decode():
            "endpoint.cuda_ipc is not a CUDA IPC handle: pickle data was truncated",
        encode(tuple(plain[:5])): "endpoint.cuda_ipc must hold 13 fields, got 5",
        encode(tuple(plain[:4] + [-1.5] + plain[5:])): "endpoint.cuda_ipc field device must be int, got -1.5",
        encode(tuple([(4, "x")] + plain[1:])): "endpoint.cuda_ipc field size must be tuple, got (4, 'x')",
        encode(tuple(plain[:3] + ["Tensor"] + plain[4:])): "endpoint.cuda_ipc field dtype 'Tensor' is not a torch dtype",
        encode(tuple(plain[:5] + [None] + plain[6:])): None,  # an empty storage has no handle
    }
    for handle, message in cases.items():
        if message is None:
            assert load_cuda_ipc(handle)[7] is None
            continue
        with pytest.raises(ValueError) as err:
            load_cuda_ipc(handle)
        assert str(err.value) == message
    with pytest.raises(ValueError) as err:
        ipc_plain_args((torch.nn.Parameter,) + TORCH_ARGS[1:])
    assert str(err.value) == "only plain tensors are exported over CUDA IPC, not Parameter on TypedStorage"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_tensor_exported_and_opened_in_this_process_is_the_same_memory():
    from engine.kv_transfer.io import export_cuda_ipc, open_cuda_ipc

    pool = torch.arange(4096, dtype=torch.bfloat16, device="cuda").view(16, 256)
    opened = open_cuda_ipc(export_cuda_ipc(pool[4:]))  # torch finds its own export in its cache
    assert opened.shape == (12, 256) and opened.dtype == torch.bfloat16
    assert opened.data_ptr() == pool[4:].data_ptr() and torch.equal(opened, pool[4:])
