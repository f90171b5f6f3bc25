"""Block copies between pools (block-major: a run of consecutive blocks is one contiguous range)."""

from __future__ import annotations

import torch

from splitserve.engine.kv_connectors.shm_pool import copy_blocks
from splitserve.engine.worker.kv_cache import as_bytes
from splitserve.kernels.block_copy import copy_blocks_by_index

MAX_DIRECT_RUNS = 16  # on a GPU, beyond this, a launch a run costs more than one indexed copy of every block


def block_run(ids: list[int]) -> int | None:
    """The first id when `ids` are consecutive (b, b+1, ...), else None. Both sides of an NCCL
    transfer decide from the source ids alone whether the sender skips its gather."""
    if ids and ids[-1] - ids[0] == len(ids) - 1 and all(b - a == 1 for a, b in zip(ids, ids[1:])):
        return ids[0]
    return None


def block_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """Maximal (src_start, dst_start, count) runs where both sides advance by one block."""
    runs: list[list[int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def copy_block_runs(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]) -> int:
    """Copy blocks src[src_ids] -> dst[dst_ids] in a single pass with no staging: one copy per run of
    consecutive blocks (on a CPU, however many: a memcpy each), or on one GPU, past MAX_DIRECT_RUNS runs, one
    kernel that copies every block by index. Between two GPUs, that many runs are gathered, moved at once and
    scattered. Returns bytes."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"copy_block_runs: {len(src_ids)} source blocks vs {len(dst_ids)} destination blocks")
    for side, ids, pool in (("source", src_ids, src), ("destination", dst_ids, dst)):
        if ids and not 0 <= min(ids) <= max(ids) < pool.shape[0]:  # a slice past the end would broadcast
            raise ValueError(
                f"copy_block_runs: {side} block ids {min(ids)}..{max(ids)} outside the pool's {pool.shape[0]} blocks"
            )
    src, dst = as_bytes(src), as_bytes(dst)  # fp8 pools move as bytes
    runs = block_runs(src_ids, dst_ids)
    if len(runs) > MAX_DIRECT_RUNS and src.is_cuda:
        if src.device == dst.device and src.is_contiguous() and dst.is_contiguous():
            return copy_blocks_by_index(src, src_ids, dst, dst_ids)
        return copy_blocks(src, src_ids, dst, dst_ids)
    for s, d, n in runs:
        dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
    return len(src_ids) * src[0].numel() * src.element_size()
