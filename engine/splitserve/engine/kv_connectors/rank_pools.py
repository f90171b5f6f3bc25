"""Every rank's KV pool of a tensor-parallel instance, allocated by its rank 0 where rank 0 can address them all
and each rank > 0 can open its own: a shared-memory segment per rank on CPU, a CUDA IPC-exported pool on each
rank's GPU. The transports whose rank 0 moves every rank's heads use it (shm, cuda_ipc, nccl); each rank > 0 gets
its pool through the opener rank 0 sends it (`TpRankPools.openers`, worker/rank_setup.py).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch

from splitserve.common.kv_layout import KvLayout
from splitserve.engine.kv_connectors.ipc_handle import check_shape, export_cuda_ipc, load_cuda_ipc, rebuild
from splitserve.engine.kv_connectors.shm_pool import SharedKvPool, open_rank_pool, segment_name, unlink_stale
from splitserve.engine.worker.kv_cache import allocate_kv_cache, torch_dtype

log = logging.getLogger("splitserve.kv")

_OPENED_BY_RANK: list[torch.Tensor] = []  # a rank > 0's mapped CUDA pool, kept for the life of the process


@dataclass
class TpRankPools:
    """Rank r's pool is `tensors[r]`; `names[r]` is what a peer or rank r opens it by (a segment name, a CUDA IPC
    handle); `segments` the shared-memory segments this process owns (closed and unlinked by `close`)."""

    tensors: list[torch.Tensor]
    names: list[str]
    segments: list[SharedKvPool] = field(default_factory=list)

    def openers(self) -> list | None:
        """Per rank, a picklable `opener(layout, num_blocks, device) -> pool` (None at rank 0)."""
        if len(self.tensors) < 2:
            return None
        if self.segments:
            return [None] + [functools.partial(open_rank_pool, name) for name in self.names[1:]]
        return [None] + [functools.partial(open_cuda_rank_pool, handle) for handle in self.names[1:]]

    def close(self) -> None:
        for pool in self.segments:
            pool.close()
        self.segments = []
        self.tensors = []


def shared_rank_pools(instance: str, start_epoch: int, layout: KvLayout, num_blocks: int) -> TpRankPools:
    """CPU: a shared-memory segment per rank, named after the instance's run (stale ones of the instance are
    unlinked first); rank r > 0's is rank 0's name with `-r<r>`."""
    for stale in unlink_stale(instance):
        log.info("unlinked stale KV segment %s", stale)
    name = segment_name(instance, start_epoch)
    names = [name] + [f"{name}-r{rank}" for rank in range(1, layout.tensor_parallel_size)]
    segments = [SharedKvPool.create(n, layout, num_blocks) for n in names]
    return TpRankPools([pool.tensor for pool in segments], names, segments)


def exported_rank_pools(layout: KvLayout, num_blocks: int, device: torch.device) -> TpRankPools:
    """CUDA: rank r's pool on `device` + r (as the ranks are placed), each exported by a CUDA IPC handle."""
    devices = [torch.device("cuda", device.index + rank) for rank in range(layout.tensor_parallel_size)]
    tensors = [allocate_kv_cache(layout, num_blocks, d) for d in devices]
    return TpRankPools(tensors, [export_cuda_ipc(pool) for pool in tensors])


def place_rank_pools(instance: str, start_epoch: int, layout: KvLayout, num_blocks: int, device) -> TpRankPools:
    """Every rank's pool where rank 0 addresses them all: segments on CPU, exported pools on CUDA."""
    if device.type == "cpu":
        return shared_rank_pools(instance, start_epoch, layout, num_blocks)
    return exported_rank_pools(layout, num_blocks, device)


def open_cuda_rank_pool(handle: str, layout: KvLayout, num_blocks: int, device: torch.device) -> torch.Tensor:
    """A tensor-parallel rank > 0's pool: the one its rank 0 allocated on this rank's GPU (the opener
    `TpRankPools.openers` gives), checked to be that pool on that device before it is mapped."""
    args = load_cuda_ipc(handle)
    check_shape(args, tuple(layout.cache_shape(num_blocks)), torch_dtype(layout))
    if device.type != "cuda" or args[6] != device.index:
        raise ValueError(f"rank pool handle: the pool is on cuda:{args[6]}, this rank runs on {device}")
    pool = rebuild(args)
    _OPENED_BY_RANK.append(pool)
    return pool
