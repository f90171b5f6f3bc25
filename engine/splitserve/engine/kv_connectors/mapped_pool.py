"""The base of connectors whose decode maps the prefill's pool and copies out of it: `shm.ShmConnector` (a
named shared-memory segment, CPU) and `cuda_ipc.CudaIpcConnector` (a CUDA IPC handle, same-host GPUs). The
prefill does nothing per pull.

Pool mappings change on the core thread only (`map_source`, `prepare_pull`); a worker keeps its own reference
to the source, so a restarted prefill's new pool replacing the mapping leaves a running copy's source in place.

Tensor parallel: an instance's rank 0 places every rank's pool where the other process can reach it (a shared
segment, a CUDA IPC handle), the endpoint names them all (`_rank_endpoints`), and the decode's rank 0 copies each
of its ranks' heads from the prefill rank holding them (`common.kv_layout.transfer_plan`,
`head_copies.copy_planned_heads`): prefill and decode may differ in TP size.
"""

from __future__ import annotations

import logging

import torch

from splitserve.common.kv_layout import KvLayout, transfer_plan
from splitserve.engine.kv_connectors.base import KvConnector, Moved, PullTarget
from splitserve.engine.kv_connectors.block_copies import copy_block_runs
from splitserve.engine.kv_connectors.head_copies import copy_planned_heads
from splitserve.engine.kv_connectors.shm_pool import SharedKvPool
from splitserve.engine.worker.kv_cache import as_bytes

log = logging.getLogger("splitserve.kv")


class MappedPoolConnector(KvConnector):
    """Pulls copy runs of blocks from the prefill's pool mapped here (one mapping per pool)."""

    moves_tensor_parallel = True

    def __init__(self, options: dict) -> None:
        super().__init__(options)
        self._mapped: dict[str, torch.Tensor | SharedKvPool] = {}  # pool key -> mapping
        self._mapped_by_instance: dict[str, str] = {}  # prefill instance -> its current pool key
        self.layout: KvLayout | None = None  # this instance's (one rank's pool), set by place_pool
        self._rank_tensors: list[torch.Tensor] = []  # tensor parallel: every rank's pool, rank 0's first

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

    def prepare_pull(self, spec) -> torch.Tensor | list[torch.Tensor]:
        """The prefill's pool mapped here, or (tensor parallel) every rank's, in rank order."""
        endpoints = self._rank_endpoints(spec.endpoint)
        if endpoints is None:
            return self.map_source(spec.prefill_instance, spec.transport, spec.endpoint, spec.layout)
        return [
            self.map_source(f"{spec.prefill_instance}#r{rank}", spec.transport, endpoint, spec.layout)
            for rank, endpoint in enumerate(endpoints)
        ]

    def pull(self, spec, indices: list[int], dst_blocks: list[int], target: PullTarget) -> Moved:
        if not indices:
            return Moved(0)
        if spec.layout.tensor_parallel_size > 1 or self._own_tp_size() > 1:
            return self._pull_planned(spec, indices, dst_blocks, target)
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
            # tensors; split over several streams or issued by the destination is slower (docs/performance.md)
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            events[0].record(stream)
            num_bytes = copy_block_runs(src, src_ids, kv_cache, dst_blocks)
            events[1].record(stream)
        events[1].synchronize()  # this worker waits; the core's stream runs on
        return Moved(num_bytes, int(events[0].elapsed_time(events[1]) * 1e6))

    def _pull_planned(self, spec, indices: list[int], dst_blocks: list[int], target: PullTarget) -> Moved:
        """Tensor parallel: every decode rank's heads from the prefill ranks holding them, as the plan says."""
        sources = target.source if isinstance(target.source, list) else [target.source]
        targets = self._rank_tensors if self._own_tp_size() > 1 else [target.kv_cache]
        src_ids = [spec.block_ids[i] for i in indices]
        plan = transfer_plan(spec.layout, self.layout)
        with self._side_stream(target.kv_cache) as stream:
            # pools as bytes: CPU index_copy_ has no fp8 kernel
            num_bytes = copy_planned_heads(
                [as_bytes(s) for s in sources], src_ids, [as_bytes(t) for t in targets], dst_blocks, plan
            )
        if stream is not None:  # copies that land on other ranks' GPUs run on those devices' streams: wait for all
            for device in {t.device for t in targets} | {target.kv_cache.device}:
                torch.cuda.synchronize(device)
        return Moved(num_bytes)

    def _own_tp_size(self) -> int:
        return self.layout.tensor_parallel_size if self.layout is not None else 1

    def release_transport(self) -> None:
        self._rank_tensors = []
        for pool in self._mapped.values():
            if isinstance(pool, SharedKvPool):
                pool.close()
        self._mapped.clear()

    # -- per transport ------------------------------------------------------------------------
    def _pool_key(self, endpoint: dict) -> str:
        raise NotImplementedError

    def _open(self, endpoint: dict, layout: KvLayout, num_blocks: int) -> torch.Tensor | SharedKvPool:
        raise NotImplementedError

    def _rank_endpoints(self, endpoint: dict) -> list[dict] | None:
        """A tensor-parallel prefill's endpoint as one endpoint per rank (each `_open`s alone); None: one pool."""
        raise NotImplementedError
