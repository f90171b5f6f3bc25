"""The `shm` transport: a CPU prefill's pool in a named shared-memory segment, mapped by the decode.

Tensor parallel: every rank's pool is a segment of its own, all created by rank 0's connector (ranks > 0 open
theirs by name), and the endpoint names them all (`shm_rank_names`); the decode's rank 0 maps the prefill ranks'
segments and writes its own ranks' (mapped_pool.py).
"""

from __future__ import annotations

import logging

import torch

from splitserve.common.kv_layout import KvLayout
from splitserve.engine.kv_connectors.mapped_pool import MappedPoolConnector
from splitserve.engine.kv_connectors.rank_pools import TpRankPools, shared_rank_pools
from splitserve.engine.kv_connectors.shm_pool import SharedKvPool
from splitserve.engine.worker.kv_cache import allocate_kv_cache

log = logging.getLogger("splitserve.kv")


class ShmConnector(MappedPoolConnector):
    """CPU, same host: a prefill's pool lives in a shared-memory segment named per instance and start epoch
    (stale ones of the instance unlinked at start); the decode maps it and copies blocks out."""

    transport = "shm"

    def __init__(self, options: dict) -> None:
        super().__init__(options)
        self._own_pool: SharedKvPool | None = None
        self._rank_pools: TpRankPools | None = None  # every rank's segment, rank 0's first

    def place_pool(self, layout: KvLayout, num_blocks: int, device: torch.device) -> torch.Tensor:
        self.layout = layout
        size = layout.tensor_parallel_size
        # a tensor-parallel decode's ranks' pools are shared too: its rank 0 writes every rank's heads
        if device.type != "cpu" or not (self.exports or size > 1):
            return allocate_kv_cache(layout, num_blocks, device)
        self._rank_pools = shared_rank_pools(self.instance, self.start_epoch, layout, num_blocks)
        self._rank_tensors = self._rank_pools.tensors
        self._own_pool = self._rank_pools.segments[0]
        names = self._rank_pools.names
        self.endpoint = {"shm_name": names[0], "num_blocks": str(num_blocks)}
        if size > 1:
            self.endpoint["shm_rank_names"] = ",".join(names)
        return self._own_pool.tensor

    def rank_pool_openers(self) -> list | None:
        return self._rank_pools.openers() if self._rank_pools is not None else None

    def _pool_key(self, endpoint: dict) -> str:
        return endpoint["shm_name"]

    def _open(self, endpoint: dict, layout: KvLayout, num_blocks: int) -> SharedKvPool:
        return SharedKvPool.open(endpoint["shm_name"], layout, num_blocks)

    def _rank_endpoints(self, endpoint: dict) -> list[dict] | None:
        names = endpoint.get("shm_rank_names")
        if not names:
            return None
        return [{"shm_name": name, "num_blocks": endpoint["num_blocks"]} for name in names.split(",")]

    def release_transport(self) -> None:
        super().release_transport()
        if self._rank_pools is not None:
            self._rank_pools.close()
        self._rank_pools = None
        self._own_pool = None
