"""The `shm` transport: a CPU prefill's pool in a named shared-memory segment, mapped by the decode."""

from __future__ import annotations

import logging

import torch

from splitserve.common.kv_layout import KvLayout
from splitserve.engine.kv_connectors.mapped_pool import MappedPoolConnector
from splitserve.engine.kv_connectors.shm_pool import SharedKvPool, segment_name, unlink_stale
from splitserve.engine.worker.kv_cache import allocate_kv_cache

log = logging.getLogger("splitserve.kv")


class ShmConnector(MappedPoolConnector):
    """CPU, same host: a prefill's pool lives in a shared-memory segment named per instance and start epoch
    (stale ones of the instance unlinked at start); the decode maps it and copies blocks out."""

    transport = "shm"

    def __init__(self, options: dict) -> None:
        super().__init__(options)
        self._own_pool: SharedKvPool | None = None

    def place_pool(self, layout: KvLayout, num_blocks: int, device: torch.device) -> torch.Tensor:
        if not (self.exports and device.type == "cpu"):
            return allocate_kv_cache(layout, num_blocks, device)
        for name in unlink_stale(self.instance):
            log.info("unlinked stale KV segment %s", name)
        name = segment_name(self.instance, self.start_epoch)
        self._own_pool = SharedKvPool.create(name, layout, num_blocks)
        self.endpoint = {"shm_name": name, "num_blocks": str(num_blocks)}
        return self._own_pool.tensor

    def _pool_key(self, endpoint: dict) -> str:
        return endpoint["shm_name"]

    def _open(self, endpoint: dict, layout: KvLayout, num_blocks: int) -> SharedKvPool:
        return SharedKvPool.open(endpoint["shm_name"], layout, num_blocks)

    def release_transport(self) -> None:
        super().release_transport()
        if self._own_pool is not None:
            self._own_pool.close()
