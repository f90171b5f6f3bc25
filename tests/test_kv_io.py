"""KvIo's decode-side pool mappings: one per pool, a restarted prefill's new pool replaces the old."""

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
