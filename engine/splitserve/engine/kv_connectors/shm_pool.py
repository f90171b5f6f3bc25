"""Shared-memory transport (same host, CPU): the prefill's whole KV pool lives in a named
POSIX shared-memory segment; a decode maps it read-only by name and copies blocks out.

Segment name: `splitserve-kv-<instance>-<start_epoch>-p<owner pid>`, and `-r<rank>` after it for the pools of
a tensor-parallel instance's ranks > 0 (rank 0 creates and owns them all); a restarted instance gets a new
name, and `unlink_stale` removes segments that earlier runs of the same instance left (owner gone).
"""

from __future__ import annotations

import glob
import os
import re
from multiprocessing import shared_memory

import torch

from splitserve.common.kv_layout import KvLayout
from splitserve.engine.worker.kv_cache import as_bytes, torch_dtype

PREFIX = "splitserve-kv-"


def segment_name(instance: str, start_epoch: int, pid: int | None = None, prefix: str = PREFIX) -> str:
    """The segment of one run of `instance`: its start epoch and the owning process (this one by default).
    `prefix` says what the segment holds (the KV pool by default; the lease table: kv_connectors/lease_slots.py)."""
    return f"{prefix}{instance}-{start_epoch}-p{os.getpid() if pid is None else pid}"


def unlink_stale(instance: str, prefix: str = PREFIX) -> list[str]:
    """Remove /dev/shm segments that earlier runs of this instance left (their owner process is gone); returns
    their names. A segment whose owner still runs is kept: another service of the same name on this host (test
    stacks run side by side) must not lose its pool."""
    pattern = re.compile(rf"{re.escape(prefix + instance)}-\d+(?:-p(\d+))?(?:-r\d+)?")
    removed = []
    for path in glob.glob(f"/dev/shm/{glob.escape(prefix + instance)}-*"):
        name = os.path.basename(path)
        match = pattern.fullmatch(name)
        if match is None or (match.group(1) and _alive(int(match.group(1)))):
            continue  # another instance's (a longer name), or its owner runs
        try:
            os.unlink(path)
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True


def _untrack(shm: shared_memory.SharedMemory) -> None:
    # Python's resource tracker would unlink segments it did not create when this
    # process exits; ownership stays with the creating process.
    try:
        from multiprocessing import resource_tracker

        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    except Exception:
        pass


class SharedKvPool:
    """Creates (owner) or maps (reader) a KV pool in shared memory."""

    def __init__(self, shm: shared_memory.SharedMemory, layout: KvLayout, num_blocks: int, owner: bool) -> None:
        self.shm = shm
        self.owner = owner
        # torch lets go of a buffer's export once it has the pointer, so a tensor on `shm.buf` itself would not stop
        # close() from unmapping the segment under it; a memoryview of our own, which the tensor keeps alive, does
        # (a copy in flight on a transfer worker holds a view of the pool)
        exported = memoryview(shm.buf)
        flat = torch.frombuffer(exported, dtype=torch_dtype(layout), count=num_blocks * layout.block_numel)
        self.tensor = flat.view(layout.cache_shape(num_blocks))  # (N, L, 2, bs, Hkv, D)

    @classmethod
    def create(cls, name: str, layout: KvLayout, num_blocks: int) -> SharedKvPool:
        """A new segment holding the whole pool, its memory taken now. A new segment is sparse: its pages were
        taken as blocks were first used, so the prefill's memory grew over hours (by up to the pool's size, as
        the free-block order reaches every block once) and a /dev/shm too small for the pool (docker's default
        is 64 MiB) killed the process with SIGBUS mid-run. Reserving and touching every page at the start makes
        the memory flat from then on and a /dev/shm too small a clear error at start."""
        nbytes = num_blocks * layout.block_nbytes
        shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        try:
            os.posix_fallocate(shm._fd, 0, nbytes)  # noqa: SLF001  (the segment's file: reserve its pages)
        except OSError as exc:
            shm.close()
            shm.unlink()
            raise ValueError(
                f"shared memory cannot hold the KV pool: {num_blocks} blocks need {nbytes:,} bytes in /dev/shm "
                f"({os.strerror(exc.errno)}); give /dev/shm more room (docker: --shm-size) or set --num-kv-blocks "
                "lower"
            ) from None
        pool = cls(shm, layout, num_blocks, owner=True)
        pool.tensor.view(-1).zero_()  # every page mapped now (the segment is zeros already: only the faults cost)
        return pool

    @classmethod
    def open(cls, name: str, layout: KvLayout, num_blocks: int) -> SharedKvPool:
        shm = shared_memory.SharedMemory(name=name, create=False)
        _untrack(shm)
        need = num_blocks * layout.block_nbytes
        if shm.size < need:
            shm.close()
            raise ValueError(f"shared KV segment {name} has {shm.size} bytes, layout needs {need}")
        return cls(shm, layout, num_blocks, owner=False)

    def close(self) -> None:
        """Unmap (unless a tensor still views the pool: then the mapping ends with the last view) and, as the
        owner, unlink the name."""
        del self.tensor
        try:
            self.shm.close()
        except BufferError:  # a view is alive (the engine's pool, a copy in flight): the mmap goes with the last one
            self.shm._mmap = None  # noqa: SLF001  (SharedMemory's __del__ must not try again and warn)
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


_OPENED_BY_RANK: list[SharedKvPool] = []  # a rank > 0's mapping of its pool, kept for the process's life


def open_rank_pool(name: str, layout: KvLayout, num_blocks: int, device: torch.device) -> torch.Tensor:
    """A tensor-parallel rank > 0's pool: the segment its rank 0 created (the opener `ShmConnector` sends)."""
    if device.type != "cpu":
        raise ValueError(f"a shared-memory KV pool is on the CPU, not {device}")
    pool = SharedKvPool.open(name, layout, num_blocks)
    _OPENED_BY_RANK.append(pool)
    return pool.tensor


def copy_blocks(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]) -> int:
    """Gather src blocks and scatter them into dst blocks (one pass each); returns bytes moved."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"copy_blocks: {len(src_ids)} source blocks vs {len(dst_ids)} destination blocks")
    if not src_ids:
        return 0
    src, dst = as_bytes(src), as_bytes(dst)  # fp8: CPU index_copy_ has no fp8 kernel
    src_index = torch.tensor(src_ids, dtype=torch.int64, device=src.device)
    dst_index = torch.tensor(dst_ids, dtype=torch.int64, device=dst.device)
    staged = src.index_select(0, src_index).to(dst.device, non_blocking=True)  # (n, L, 2, bs, Hkv, D)
    dst.index_copy_(0, dst_index, staged)
    return staged.numel() * staged.element_size()
