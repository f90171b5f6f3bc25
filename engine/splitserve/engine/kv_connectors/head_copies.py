"""Copying blocks between pools of different tensor-parallel sizes, head by head, as a transfer plan says.

A pool is (num_blocks, num_layers, 2, block_size, heads of its rank, head_dim) (common.kv_layout). A plan
(`common.kv_layout.transfer_plan`) gives each decode rank, per pool head, the prefill rank and pool head
to read: consecutive heads read from consecutive heads of one prefill rank are copied as one slice.

    prefill TP 2: rank 0 [h0 h1]  rank 1 [h2 h3]          decode TP 1: rank 0 [h0 h1 h2 h3]
                       └─ one slice ─┘   └─ one slice ─┘  ─────▶       [ from 0 | from 1 ]

This is the copy step alone, on pools this process can address (mapped shared memory, or device
tensors); which process runs it for which ranks is the transport's business.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.common.kv_layout import RankPlan


def head_runs(plan: RankPlan) -> list[tuple[int, int, int, int]]:
    """A decode rank's plan as runs (dst_head, src_rank, src_head, count) of consecutive heads."""
    runs: list[list[int]] = []
    for dst, src_rank, src in plan:
        last = runs[-1] if runs else None
        if last and last[1] == src_rank and last[0] + last[3] == dst and last[2] + last[3] == src:
            last[3] += 1
        else:
            runs.append([dst, src_rank, src, 1])
    return [tuple(run) for run in runs]


def copy_planned_heads(
    sources: Sequence[torch.Tensor],
    src_blocks: list[int],
    targets: Sequence[torch.Tensor],
    dst_blocks: list[int],
    plan: Sequence[RankPlan],
) -> int:
    """Blocks `src_blocks` of the prefill ranks' pools (`sources[r]`) into blocks `dst_blocks` of the decode
    ranks' pools (`targets[r]`), every decode rank's heads from where `plan` says. Returns the bytes written."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"copy_planned_heads: {len(src_blocks)} source blocks vs {len(dst_blocks)} destination blocks")
    if len(targets) != len(plan):
        raise ValueError(f"copy_planned_heads: {len(targets)} decode pools for a plan of {len(plan)} ranks")
    if not src_blocks:
        return 0
    num_bytes = 0
    for target, rank_plan in zip(targets, plan):
        dst_ids = torch.tensor(dst_blocks, dtype=torch.int64, device=target.device)
        for dst_head, src_rank, src_head, count in head_runs(rank_plan):
            source = sources[src_rank]
            src_ids = torch.tensor(src_blocks, dtype=torch.int64, device=source.device)
            piece = source.index_select(0, src_ids)[..., src_head : src_head + count, :]  # (N, L, 2, bs, count, D)
            target[..., dst_head : dst_head + count, :].index_copy_(0, dst_ids, piece.to(target.device))
            num_bytes += piece.numel() * piece.element_size()
    return num_bytes
