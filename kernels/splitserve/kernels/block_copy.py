"""Whole KV blocks copied between two block-major pools by index, in one pass: dst[dst_ids[i]] = src[src_ids[i]].

A KV pull out of a fragmented pool moves many runs of blocks. One `copy_` a run pays a launch and the host's
time for each (thousands for a long prompt), and a gather (`index_select`) then scatter (`index_copy_`) moves
every byte twice through a staging tensor; this kernel reads each source block once and writes it once.

The pools are viewed as words of the widest size (8, 4, 2 or 1 bytes) that divides a block's bytes and both
pools' offsets, so any dtype (fp8 included) moves as bits. Program (i, c) copies chunk c of the i-th block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._common import use_triton

_CHUNK_BYTES = 32768  # a program's share of a block
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, words_per_block, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < words_per_block
    src_block = tl.load(src_ids_ptr + i).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + i).to(tl.int64)
    words = tl.load(src_ptr + src_block * words_per_block + offs, mask=mask)
    tl.store(dst_ptr + dst_block * words_per_block + offs, words, mask=mask)


def _as_words(pool: torch.Tensor, word: int) -> torch.Tensor:
    """(num_blocks, words a block) view of a contiguous pool's bytes."""
    return pool.view(torch.uint8).view(pool.shape[0], -1).view(_WORDS[word])


def copy_blocks_by_index(
    src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int], impl: str = "auto"
) -> int:
    """dst[dst_ids[i]] = src[src_ids[i]] for every i, whole blocks (dim 0), bit for bit; returns the bytes moved.
    Both pools contiguous, with the same block shape and element size, on one device."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"copy_blocks_by_index: {len(src_ids)} source blocks vs {len(dst_ids)} destination blocks")
    if src.shape[1:] != dst.shape[1:] or src.element_size() != dst.element_size():
        raise ValueError(
            f"copy_blocks_by_index: block shapes differ: source {tuple(src.shape[1:])} x {src.element_size()} B, "
            f"destination {tuple(dst.shape[1:])} x {dst.element_size()} B"
        )
    if src.device != dst.device or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_blocks_by_index: both pools must be contiguous and on one device")
    for side, ids, pool in (("source", src_ids, src), ("destination", dst_ids, dst)):
        if ids and not 0 <= min(ids) <= max(ids) < pool.shape[0]:
            raise ValueError(
                f"copy_blocks_by_index: {side} block ids {min(ids)}..{max(ids)} outside the pool's "
                f"{pool.shape[0]} blocks"
            )
    if len(set(dst_ids)) != len(dst_ids):
        raise ValueError("copy_blocks_by_index: a destination block appears twice")
    block_bytes = src[0].numel() * src.element_size()
    if not src_ids:
        return 0
    offsets = (src.storage_offset() * src.element_size(), dst.storage_offset() * dst.element_size())
    word = next(w for w in _WORDS if block_bytes % w == 0 and all(o % w == 0 for o in offsets))
    src_words, dst_words = _as_words(src, word), _as_words(dst, word)
    if not use_triton(impl, src, "copy_blocks_by_index"):
        index = torch.tensor(src_ids, dtype=torch.int64, device=src.device)
        dst_words.index_copy_(0, torch.tensor(dst_ids, dtype=torch.int64, device=dst.device), src_words[index])
        return len(src_ids) * block_bytes
    src_rows, dst_rows = index_rows(src_ids, dst_ids, src.device)
    words_per_block = block_bytes // word
    chunk = min(triton.next_power_of_2(words_per_block), _CHUNK_BYTES // word)
    grid = (len(src_ids), triton.cdiv(words_per_block, chunk))
    _copy_blocks_kernel[grid](src_words, dst_words, src_rows, dst_rows, words_per_block, CHUNK=chunk)
    return len(src_ids) * block_bytes


def index_rows(src_ids: list[int], dst_ids: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Both id lists as int32 rows of one device tensor (one copy), each starting at a 16-byte boundary: Triton
    compiles a kernel per pointer alignment, and a second row right after n ids was aligned only when 4 divided n
    (a copy of a new length class compiled a variant while serving)."""
    n, pad = len(src_ids), [0] * (-len(src_ids) % 4)
    rows = torch.tensor([src_ids + pad, dst_ids + pad], dtype=torch.int32).to(device, non_blocking=True)
    return rows[0, :n], rows[1, :n]
