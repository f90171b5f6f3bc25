"""KvIo's decode-side pool mappings: one per pool, a restarted prefill's new pool replaces the old."""

import pytest
import torch

from engine.kv_layout import KvLayout
from engine.kv_transfer.io import KvIo
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


def test_wake_targets_are_written_replaced_and_dropped_when_broken():
    """A prefill writes WAKE_BYTES to each registered decode's buffer per finished prefill step; a decode that
    registers again replaces its buffer; a buffer that cannot be written is dropped, the others still are."""
    from engine.kv_transfer.io import WAKE_BYTES

    io = KvIo({"transport": "nccl", "instance": "p-wake", "role": "prefill"})

    def counts():
        return {k: v for k, v in io.stats().items() if k in ("kv_link_wakes", "kv_wake_targets")}

    cpu = torch.device("cpu")
    a, b = torch.zeros(WAKE_BYTES, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    io.add_wake_target("d-a", a, cpu)  # registering writes once (checks the buffer is writable)
    assert int(a.sum()) == WAKE_BYTES and counts() == {"kv_link_wakes": 1, "kv_wake_targets": 1}
    io.add_wake_target("d-b", b, cpu)
    a.zero_(), b.zero_()
    assert io.wake_links() == 2
    assert int(a.sum()) == WAKE_BYTES and int(b.sum()) == 64  # a smaller buffer gets what fits
    assert counts() == {"kv_link_wakes": 4, "kv_wake_targets": 2}
    a2 = torch.zeros(16, dtype=torch.uint8)
    io.add_wake_target("d-a", a2, cpu)  # d-a restarted: its new buffer replaces the old one
    a.zero_()
    assert io.wake_links() == 2 and int(a.sum()) == 0 and int(a2.sum()) == 16
    io._wake_targets["d-b"] = torch.zeros(8, requires_grad=True)  # not writable in place
    assert io.wake_links() == 1
    assert counts() == {"kv_link_wakes": 8, "kv_wake_targets": 1}
    assert io.stats()["kv_wake_last_unix_ns"] > 0  # when the last writes were issued (their lead over a pull)
    with pytest.raises(ValueError) as err:
        io.map_wake_target("d-c", {"wake_cuda_ipc": "x"}, cpu)
    assert str(err.value) == "this prefill runs on cpu; link wake-ups need a CUDA device"
    io.close()
    assert io.stats()["kv_wake_targets"] == 0
