"""The `shm` transport: a CPU prefill's pool in a named shared-memory segment, mapped by the decode.

Tensor parallel: every rank's pool is a segment of its own, all created by rank 0's connector (ranks > 0 open
theirs by name), and the endpoint names them all (`shm_rank_names`). The decode's rank 0 maps the prefill ranks'
segments and its own ranks', and copies each decode rank's heads from the prefill rank that holds them
(`common.kv_layout.transfer_plan`, `head_copies.copy_planned_heads`): prefill and decode may differ in TP size.
"""

from __future__ import annotations

import functools
import logging

import torch

from splitserve.common.kv_layout import KvLayout, transfer_plan
from splitserve.engine.kv_connectors.base import Moved, PullTarget
from splitserve.engine.kv_connectors.head_copies import copy_planned_heads
from splitserve.engine.kv_connectors.mapped_pool import MappedPoolConnector
from splitserve.engine.kv_connectors.shm_pool import SharedKvPool, open_rank_pool, segment_name, unlink_stale
from splitserve.engine.worker.kv_cache import allocate_kv_cache, as_bytes

log = logging.getLogger("splitserve.kv")


class ShmConnector(MappedPoolConnector):
    """CPU, same host: a prefill's pool lives in a shared-memory segment named per instance and start epoch
    (stale ones of the instance unlinked at start); the decode maps it and copies blocks out."""

    transport = "shm"

    def __init__(self, options: dict) -> None:
        super().__init__(options)
        self._own_pool: SharedKvPool | None = None
        self._rank_pools: list[SharedKvPool] = []  # tensor parallel: every rank's pool, rank 0's first
        self.layout: KvLayout | None = None  # this instance's (one rank's pool)

    def place_pool(self, layout: KvLayout, num_blocks: int, device: torch.device) -> torch.Tensor:
        self.layout = layout
        size = layout.tensor_parallel_size
        # a tensor-parallel decode's ranks' pools are shared too: its rank 0 writes every rank's heads
        if device.type != "cpu" or not (self.exports or size > 1):
            return allocate_kv_cache(layout, num_blocks, device)
        for name in unlink_stale(self.instance):
            log.info("unlinked stale KV segment %s", name)
        name = segment_name(self.instance, self.start_epoch)
        names = [name] + [f"{name}-r{rank}" for rank in range(1, size)]
        self._rank_pools = [SharedKvPool.create(n, layout, num_blocks) for n in names]
        self._own_pool = self._rank_pools[0]
        self.endpoint = {"shm_name": name, "num_blocks": str(num_blocks)}
        if size > 1:
            self.endpoint["shm_rank_names"] = ",".join(names)
        return self._own_pool.tensor

    def rank_pool_openers(self) -> list | None:
        if len(self._rank_pools) < 2:
            return None
        return [None] + [functools.partial(open_rank_pool, pool.shm.name) for pool in self._rank_pools[1:]]

    def check_layout(self, source: KvLayout, own: KvLayout) -> None:
        """Equal layouts, or ones a transfer plan maps (ValueError naming both otherwise)."""
        if source == own:
            return
        if source.tensor_parallel_size == 1 and own.tensor_parallel_size == 1:
            raise ValueError(own.mismatch(source))
        transfer_plan(source, own)

    def prepare_pull(self, spec):
        """The prefill's pool mapped here, or (tensor parallel) every rank's, in rank order."""
        names = spec.endpoint.get("shm_rank_names")
        if not names:
            return super().prepare_pull(spec)
        return [
            self.map_source(
                f"{spec.prefill_instance}#r{rank}",
                spec.transport,
                {"shm_name": name, "num_blocks": spec.endpoint["num_blocks"]},
                spec.layout,
            )
            for rank, name in enumerate(names.split(","))
        ]

    def pull(self, spec, indices: list[int], dst_blocks: list[int], target: PullTarget) -> Moved:
        own_size = self.layout.tensor_parallel_size if self.layout is not None else 1
        if spec.layout.tensor_parallel_size == 1 and own_size == 1:
            return super().pull(spec, indices, dst_blocks, target)
        sources = target.source if isinstance(target.source, list) else [target.source]
        targets = [pool.tensor for pool in self._rank_pools] if own_size > 1 else [target.kv_cache]
        src_ids = [spec.block_ids[i] for i in indices]
        plan = transfer_plan(spec.layout, self.layout)
        # fp8 pools as bytes: CPU index_copy_ has no fp8 kernel
        return Moved(
            copy_planned_heads(
                [as_bytes(s) for s in sources], src_ids, [as_bytes(t) for t in targets], dst_blocks, plan
            )
        )

    def _pool_key(self, endpoint: dict) -> str:
        return endpoint["shm_name"]

    def _open(self, endpoint: dict, layout: KvLayout, num_blocks: int) -> SharedKvPool:
        return SharedKvPool.open(endpoint["shm_name"], layout, num_blocks)

    def release_transport(self) -> None:
        super().release_transport()
        for pool in self._rank_pools:
            pool.close()
        self._rank_pools = []
        self._own_pool = None
