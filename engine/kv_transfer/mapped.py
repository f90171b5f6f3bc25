"""Connectors whose decode maps the prefill's pool and copies out of it: `shm` (a named shared-memory
segment, CPU) and `cuda_ipc` (a CUDA IPC handle, same-host GPUs). The prefill does nothing per pull.

Pool mappings change on the core thread only (`map_source`, `prepare_pull`); a worker keeps its own reference
to the source, so a restarted prefill's new pool replacing the mapping leaves a running copy's source in place.
"""

from __future__ import annotations

import logging

import torch

from splitserve.common.kv_layout import KvLayout
from splitserve.engine.kv_layout import allocate_kv_cache, torch_dtype
from splitserve.engine.kv_transfer.connector import KvConnector, Moved, PullTarget
from splitserve.engine.kv_transfer.copies import copy_block_runs
from splitserve.engine.kv_transfer.ipc_handle import check_shape, export_cuda_ipc, load_cuda_ipc, rebuild
from splitserve.engine.kv_transfer.shm import SharedKvPool, segment_name, unlink_stale

log = logging.getLogger("splitserve.kv")


class MappedPoolConnector(KvConnector):
    """Pulls copy runs of blocks from the prefill's pool mapped here (one mapping per pool)."""

    def __init__(self, options: dict) -> None:
        super().__init__(options)
        self._mapped: dict[str, torch.Tensor | SharedKvPool] = {}  # pool key -> mapping
        self._mapped_by_instance: dict[str, str] = {}  # prefill instance -> its current pool key

    def map_source(self, prefill_instance: str, transport: str, endpoint: dict, layout: KvLayout) -> torch.Tensor:
        """The prefill's KV pool, mapped once per pool; a restarted prefill's new pool replaces its old mapping."""
        if "error" in endpoint:
            raise RuntimeError(endpoint["error"])
        if transport != self.transport:
            raise ValueError(f"a {transport} pool cannot be mapped by the {self.transport} transport")
        key = self._pool_key(endpoint)
        pool = self._mapped.get(key)
        if pool is None:
            pool = self._open(endpoint, layout, int(endpoint["num_blocks"]))
            stale = self._mapped_by_instance.get(prefill_instance)
            if stale is not None and stale in self._mapped:
                old = self._mapped.pop(stale)
                if isinstance(old, SharedKvPool):
                    old.close()
                log.info("%s's KV pool changed (restarted); dropped the old mapping", prefill_instance)
            self._mapped[key] = pool
            self._mapped_by_instance[prefill_instance] = key
        return pool.tensor if isinstance(pool, SharedKvPool) else pool

    def prepare_pull(self, spec) -> torch.Tensor:
        return self.map_source(spec.prefill_instance, spec.transport, spec.endpoint, spec.layout)

    def pull(self, spec, indices: list[int], dst_blocks: list[int], target: PullTarget) -> Moved:
        if not indices:
            return Moved(0)
        kv_cache, src = target.kv_cache, target.source
        if src is None:
            raise ValueError(f"a {self.transport} pull needs the source pool prepare_pull maps")
        src_ids = [spec.block_ids[i] for i in indices]
        with self._side_stream(kv_cache) as stream:
            if stream is None:
                # CPU: runs of consecutive blocks straight from the mapped segment, one pass, no staging tensor
                # (a fresh staging tensor per pull also pays a page fault per 4 KiB)
                return Moved(copy_block_runs(src, src_ids, kv_cache, dst_blocks))
            # timed on the side stream: every way of copying below makes it wait for the copy; torch's
            # cross-device copy_ runs on the source device's stream, as fast as a copy between ordinary
            # tensors (bench/kv_copy_variants.py); split over several streams or issued by the destination is slower
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            events[0].record(stream)
            num_bytes = copy_block_runs(src, src_ids, kv_cache, dst_blocks)
            events[1].record(stream)
        events[1].synchronize()  # this worker waits; the core's stream runs on
        return Moved(num_bytes, int(events[0].elapsed_time(events[1]) * 1e6))

    def release_transport(self) -> None:
        for pool in self._mapped.values():
            if isinstance(pool, SharedKvPool):
                pool.close()
        self._mapped.clear()

    # -- per transport ------------------------------------------------------------------------
    def _pool_key(self, endpoint: dict) -> str:
        raise NotImplementedError

    def _open(self, endpoint: dict, layout: KvLayout, num_blocks: int) -> torch.Tensor | SharedKvPool:
        raise NotImplementedError


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
