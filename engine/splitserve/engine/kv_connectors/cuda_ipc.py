"""The `cuda_ipc` transport: a GPU prefill's pool exported by a CUDA IPC handle, mapped by the decode.

Tensor parallel (as shm does with segments): rank 0's connector allocates every rank's pool on that rank's GPU
(the GPUs after its own) and exports each; ranks > 0 map theirs from its handle (`rank_pools.open_cuda_rank_pool`),
and the endpoint lists every rank's handle (`cuda_ipc_ranks`). The decode's rank 0 maps the prefill ranks' pools
and writes its own ranks' heads (mapped_pool.py), GPU to GPU.
"""

from __future__ import annotations

import logging

import torch

from splitserve.common.kv_layout import KvLayout
from splitserve.engine.kv_connectors.ipc_handle import check_shape, export_cuda_ipc, load_cuda_ipc, rebuild
from splitserve.engine.kv_connectors.mapped_pool import MappedPoolConnector
from splitserve.engine.kv_connectors.rank_pools import exported_rank_pools
from splitserve.engine.worker.kv_cache import allocate_kv_cache, torch_dtype

log = logging.getLogger("splitserve.kv")


class CudaIpcConnector(MappedPoolConnector):
    """Same-host GPUs: a prefill exports its pool with a CUDA IPC handle (plain fields, checked against its
    layout before anything of it runs); the decode maps it and copies device to device on a side stream."""

    transport = "cuda_ipc"

    def __init__(self, options: dict) -> None:
        super().__init__(options)
        self._rank_handles: list[str] = []  # tensor parallel: every rank's pool's handle, rank 0's first
        self._openers: list | None = None

    def place_pool(self, layout: KvLayout, num_blocks: int, device: torch.device) -> torch.Tensor:
        self.layout = layout
        size = layout.tensor_parallel_size
        if device.type == "cuda" and size > 1:
            return self._place_rank_pools(layout, num_blocks, device)
        kv_cache = allocate_kv_cache(layout, num_blocks, device)
        if self.exports and device.type == "cuda":
            self.endpoint = {
                "cuda_ipc": export_cuda_ipc(kv_cache),
                "num_blocks": str(num_blocks),
                "device": str(device.index),
            }
        return kv_cache

    def _place_rank_pools(self, layout: KvLayout, num_blocks: int, device: torch.device) -> torch.Tensor:
        """Every rank's pool on its GPU, each exported: a decode's rank 0 writes its ranks' heads, a prefill's every
        rank's pool is read."""
        pools = exported_rank_pools(layout, num_blocks, device)
        self._rank_tensors, self._rank_handles, self._openers = pools.tensors, pools.names, pools.openers()
        self.endpoint = {
            "cuda_ipc": self._rank_handles[0],
            "num_blocks": str(num_blocks),
            "device": str(device.index),
            "cuda_ipc_ranks": ",".join(self._rank_handles),  # base64 text holds no comma
        }
        return self._rank_tensors[0]

    def rank_pool_openers(self) -> list | None:
        return self._openers

    def _pool_key(self, endpoint: dict) -> str:
        return endpoint["cuda_ipc"]

    def _open(self, endpoint: dict, layout: KvLayout, num_blocks: int) -> torch.Tensor:
        args = load_cuda_ipc(endpoint["cuda_ipc"])
        check_shape(args, tuple(layout.cache_shape(num_blocks)), torch_dtype(layout))
        pool = rebuild(args)
        self._keep_link_awake(pool.device)
        return pool

    def _rank_endpoints(self, endpoint: dict) -> list[dict] | None:
        handles = endpoint.get("cuda_ipc_ranks")
        if not handles:
            return None
        return [{"cuda_ipc": handle, "num_blocks": endpoint["num_blocks"]} for handle in handles.split(",")]

    def release_transport(self) -> None:
        super().release_transport()
        self._rank_handles = []
        self._openers = None
