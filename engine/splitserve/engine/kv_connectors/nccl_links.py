"""The nccl transport between tensor-parallel instances: one 2-rank group per (prefill rank, decode rank) that a
transfer plan joins, each carrying exactly the heads that decode rank takes from that prefill rank.

    prefill TP 2 [h0 h1] [h2 h3]        links of the pair (from common.kv_layout.transfer_plan)
    decode  TP 1 [h0 h1 h2 h3]          (p0 → d0: heads 0-1 into 0-1), (p1 → d0: heads 0-1 into 2-3)

    prefill TP 1 [h0 h1 h2 h3]          (p0 → d0: heads 0-1 into 0-1), (p0 → d1: heads 2-3 into 0-1)
    decode  TP 2 [h0 h1] [h2 h3]

Each instance's rank 0 holds every rank's pool (kv_connectors/rank_pools.py: shared memory on CPU, IPC-exported
on each rank's GPU), so its connector runs every link: a send gathers the link's heads of the blocks from that
prefill rank's pool, a receive scatters them into that decode rank's pool; one pull's links move in parallel,
each byte once, straight between the two ranks' devices. The ranks > 0 take no part (they only step).

At pairing the two sides swap layouts through the pair's store (`LAYOUT_KEY`), so both compute the same links;
layouts no plan maps fail the pairing, naming both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.common.kv_layout import KvLayout, transfer_plan
from splitserve.engine.kv_connectors.block_copies import block_run
from splitserve.engine.kv_connectors.head_copies import head_runs

LAYOUT_KEY = "layout/"  # + the side's pair rank (0 = decode, 1 = prefill): its KvLayout as protobuf bytes


@dataclass(frozen=True)
class Link:
    """One prefill rank → one decode rank of a pair: `runs` of (decode pool head, prefill pool head, count), in
    the order their heads sit in the message."""

    prefill_rank: int
    decode_rank: int
    runs: tuple[tuple[int, int, int], ...]

    @property
    def num_heads(self) -> int:
        return sum(count for _, _, count in self.runs)

    @property
    def src_heads(self) -> list[int]:
        return [src + i for _, src, count in self.runs for i in range(count)]

    def whole_source(self, heads: int) -> bool:
        """Whether the message is whole blocks of the prefill rank's pool (of `heads` heads): all, in order."""
        return len(self.runs) == 1 and self.runs[0][1:] == (0, heads)

    def whole_target(self, heads: int) -> bool:
        """Whether the message is whole blocks of the decode rank's pool (of `heads` heads): all, in order."""
        return len(self.runs) == 1 and self.runs[0][0] == 0 and self.runs[0][2] == heads

    def gather(self, pool: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
        """The link's message from the prefill rank's pool: (n, L, 2, bs, num_heads, D), contiguous."""
        whole = self.whole_source(pool.shape[-2])
        if whole and block_run(block_ids) is not None:
            return pool[block_ids[0] : block_ids[0] + len(block_ids)]  # the pool's own slice, no gather
        blocks = pool.index_select(0, torch.tensor(block_ids, dtype=torch.int64, device=pool.device))
        if whole:
            return blocks
        heads = torch.tensor(self.src_heads, dtype=torch.int64, device=pool.device)
        return blocks.index_select(-2, heads)

    def buffer(self, pool: torch.Tensor, block_ids: list[int]) -> tuple[torch.Tensor, bool]:
        """Where the link's message is received: (the destination blocks themselves, True) on CUDA when they are
        consecutive and the message is whole blocks (NCCL's abort cancels a timed-out receive; a gloo receive left
        pending could land in blocks reused by then), else (a staging tensor, False)."""
        if pool.is_cuda and self.whole_target(pool.shape[-2]) and block_run(block_ids) is not None:
            return pool[block_ids[0] : block_ids[0] + len(block_ids)], True
        shape = (len(block_ids), *pool.shape[1:-2], self.num_heads, pool.shape[-1])
        return torch.empty(shape, dtype=pool.dtype, device=pool.device), False

    def scatter(self, staging: torch.Tensor, pool: torch.Tensor, block_ids: list[int]) -> None:
        """A received staging tensor into the decode rank's pool: each run's heads of the blocks, nothing else
        (links into one pool write disjoint heads)."""
        dst = torch.tensor(block_ids, dtype=torch.int64, device=pool.device)
        offset = 0
        for dst_head, _, count in self.runs:
            piece = staging[..., offset : offset + count, :]
            pool[..., dst_head : dst_head + count, :].index_copy_(0, dst, piece)
            offset += count


def plan_links(prefill: KvLayout, decode: KvLayout) -> list[Link]:
    """The pair's links, ordered by (prefill rank, decode rank): from the transfer plan (ValueError naming both
    layouts when none maps them)."""
    links: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for decode_rank, rank_plan in enumerate(transfer_plan(prefill, decode)):
        for dst_head, src_rank, src_head, count in head_runs(rank_plan):
            links.setdefault((src_rank, decode_rank), []).append((dst_head, src_head, count))
    return [Link(p, d, tuple(runs)) for (p, d), runs in sorted(links.items())]


@dataclass
class PairLinks:
    """A pair of tensor-parallel instances (either side): both layouts, and per link its group (on this side's
    device of its rank). Stored as the pair's communicator: dropping the pair aborts every group."""

    prefill: KvLayout
    decode: KvLayout
    links: list[tuple[Link, object]]

    def abort(self) -> None:
        failures = []
        for link, group in self.links:
            try:
                group.abort() if hasattr(group, "abort") else None
            except Exception as exc:  # the others are aborted still
                failures.append(f"{link.prefill_rank}->{link.decode_rank}: {exc}")
        if failures:
            raise RuntimeError(f"aborting links failed: {'; '.join(failures)}")


def layout_bytes(layout: KvLayout | None) -> bytes:
    """What a side writes under LAYOUT_KEY: its layout as protobuf bytes (empty: none known, a bare pool)."""
    if layout is None:
        return b""
    from splitserve.common.wire import layout_to_proto

    return layout_to_proto(layout).SerializeToString()


def layout_of(data: bytes) -> KvLayout | None:
    """The peer's layout from its LAYOUT_KEY value (a malformed one raises)."""
    if not data:
        return None
    from splitserve.common.wire import layout_from_proto
    from splitserve.protos import common_pb2

    return layout_from_proto(common_pb2.KvLayout.FromString(data))


def tensor_parallel(*layouts: KvLayout | None) -> bool:
    return any(layout is not None and layout.tensor_parallel_size > 1 for layout in layouts)


def rank_pool(pools: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
    if rank >= len(pools):
        raise RuntimeError(f"link to rank {rank}: this instance holds {len(pools)} rank pool(s)")
    return pools[rank]


def synchronize(pools: Sequence[torch.Tensor]) -> None:
    """Wait for this thread's work on every pool's device: its current stream there, which the links' gathers,
    receives (`work.wait()` joins NCCL's stream into it) and scatters ran on; never the whole device, where the
    core's step may be running."""
    for device in {pool.device for pool in pools if pool.is_cuda}:
        torch.cuda.current_stream(device).synchronize()
