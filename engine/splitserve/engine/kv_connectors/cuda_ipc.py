"""The `cuda_ipc` transport: a GPU prefill's pool exported by a CUDA IPC handle, mapped by the decode."""

from __future__ import annotations

import logging

import torch

from splitserve.common.kv_layout import KvLayout
from splitserve.engine.kv_connectors.ipc_handle import check_shape, export_cuda_ipc, load_cuda_ipc, rebuild
from splitserve.engine.kv_connectors.mapped_pool import MappedPoolConnector
from splitserve.engine.worker.kv_cache import allocate_kv_cache, torch_dtype

log = logging.getLogger("splitserve.kv")


class CudaIpcConnector(MappedPoolConnector):
    """Same-host GPUs: a prefill exports its pool with a CUDA IPC handle (plain fields, checked against its
    layout before anything of it runs); the decode maps it and copies device to device on a side stream."""

    transport = "cuda_ipc"

    def place_pool(self, layout: KvLayout, num_blocks: int, device: torch.device) -> torch.Tensor:
        kv_cache = allocate_kv_cache(layout, num_blocks, device)
        if self.exports and device.type == "cuda":
            self.endpoint = {
                "cuda_ipc": export_cuda_ipc(kv_cache),
                "num_blocks": str(num_blocks),
                "device": str(device.index),
            }
        return kv_cache

    def _pool_key(self, endpoint: dict) -> str:
        return endpoint["cuda_ipc"]

    def _open(self, endpoint: dict, layout: KvLayout, num_blocks: int) -> torch.Tensor:
        args = load_cuda_ipc(endpoint["cuda_ipc"])
        check_shape(args, tuple(layout.cache_shape(num_blocks)), torch_dtype(layout))
        pool = rebuild(args)
        self._keep_link_awake(pool.device)
        return pool
