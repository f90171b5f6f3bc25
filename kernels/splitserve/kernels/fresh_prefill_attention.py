"""Causal prefill attention for prompts with nothing cached, reading the step's own keys and values.

    q:               (T, Hq, D)   the new tokens of all sequences, flattened (row stride any, D contiguous)
    k, v:            (T, Hkv, D)  their keys/values as the qkv projection left them (not the paged cache)
    query_start_loc: (B+1,) int32; sequence i owns rows [qsl[i], qsl[i+1]) and sees only those

When no sequence of a step has cached tokens (every fresh prompt, the common prefill), each
sequence's keys are one dense row range of k/v, so tiles come in through TMA descriptors (one copy
instruction per tile, no per-row address math, multicast-free but asynchronous) instead of the paged
kernel's gathered pointer loads; on sm_90 the K/V loop can also be warp-specialised (`WARP_SPEC`:
producer warps issue TMA, consumer warps run the dots and the softmax). A sequence with a cached
prefix, a chunk of a long prompt, or a decode row goes through `paged_prefill_attention`.

One program takes BLOCK_M query rows of one head of one sequence: keys [0, m0) without a mask (m0 is
a multiple of BLOCK_N), then the diagonal [m0, m0 + BLOCK_M) with it. Tiles that run past the
sequence read the next one's rows (or zeros past T): the mask hides them and the store skips them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from splitserve.kernels._common import dot_precision, interpreting

LOG2E = 1.4426950408889634


@triton.jit
def _fresh_tile(
    acc,
    l,
    m,
    q,
    k_desc,
    v_desc,
    row0,
    n0,
    kv_col,
    offs_m,
    q_len,
    qk_scale,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
):
    """Keys [n0, n0 + BLOCK_N) of the sequence starting at row0: online-softmax update of (acc, l, m)."""
    k = k_desc.load([row0 + n0, kv_col])  # (BLOCK_N, D)
    v = v_desc.load([row0 + n0, kv_col])
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PREC)  # (BLOCK_M, BLOCK_N)
    if MASKED:
        n = n0 + tl.arange(0, BLOCK_N)
        visible = (n[None, :] <= offs_m[:, None]) & (n < q_len)[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1) * qk_scale)
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
    return acc, l, m_new


@triton.jit(do_not_specialize=["num_m_tiles"])  # changes every step (paged_prefill_attention's _prefill_kernel)
def _fresh_prefill_kernel(
    q_desc,
    k_desc,
    v_desc,
    qsl_ptr,
    out_ptr,
    qk_scale,
    num_m_tiles,
    stride_ot,
    stride_oh,
    group,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
):
    head = tl.program_id(0)
    tile = num_m_tiles - 1 - tl.program_id(1)  # longest tiles first
    b = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 < q_len:
        kv_col = (head // group) * HEAD_DIM
        q = q_desc.load([q_start + m0, head * HEAD_DIM])  # (BLOCK_M, D)
        if DOT_F32:
            q = q.to(tl.float32)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        for n0 in tl.range(0, m0, BLOCK_N, num_stages=NUM_STAGES, warp_specialize=WARP_SPEC):
            acc, l, m = _fresh_tile(
                acc,
                l,
                m,
                q,
                k_desc,
                v_desc,
                q_start,
                n0,
                kv_col,
                offs_m,
                q_len,
                qk_scale,
                False,
                BLOCK_N,
                DOT_F32,
                PREC,
            )
        hi = tl.minimum(m0 + BLOCK_M, q_len)
        for n0 in tl.range(m0, hi, BLOCK_N, num_stages=NUM_STAGES):
            acc, l, m = _fresh_tile(
                acc, l, m, q, k_desc, v_desc, q_start, n0, kv_col, offs_m, q_len, qk_scale, True, BLOCK_N, DOT_F32, PREC
            )
        o = acc / l[:, None]
        rows = (q_start + offs_m).to(tl.int64)
        d = tl.arange(0, HEAD_DIM)
        tl.store(
            out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=(offs_m < q_len)[:, None],
        )


def fresh_config(head_dim: int, dtype: torch.dtype, max_query_len: int, on_cpu: bool) -> dict:
    """Tiles: 64 x 64 with 4 warps and 3 stages, the fastest swept (docs/performance.md, "Findings that set
    defaults": fresh-prompt prefill kernel); warp specialisation does not compile on sm_90 with Triton 3.6."""
    if on_cpu:
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1, WARP_SPEC=False)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, WARP_SPEC=False)


def fresh_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """TMA's rules: 16-byte aligned bases and row strides, a power-of-two head_dim of 16..256, 16-bit data."""
    head_dim = q.shape[2]
    tensors = (q, k, v)
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and 16 <= head_dim <= 256
        and head_dim & (head_dim - 1) == 0
        and all(t.stride(2) == 1 and t.stride(1) == head_dim for t in tensors)
        and all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)
    )


def _descriptor(x: torch.Tensor, rows: int) -> TensorDescriptor:
    """(T, H, D) with contiguous heads as a 2-D (T, H * D) descriptor of (rows, D) tiles."""
    return TensorDescriptor(x, [x.shape[0], x.shape[1] * x.shape[2]], [x.stride(0), 1], [rows, x.shape[2]])


def fresh_prefill_attention(q, k, v, query_start_loc, max_query_len, scale, out=None, config=None):
    """Causal attention of fresh prompts: q (T, Hq, D) over k/v (T, Hkv, D) within each sequence's rows.
    `config` overrides fresh_config (benchmarks and tests only). Needs fresh_supported(q, k, v) on a GPU."""
    num_tokens, num_q_heads, head_dim = q.shape
    batch = query_start_loc.shape[0] - 1
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0 or batch == 0 or max_query_len == 0:
        return out
    on_cpu = interpreting(q)
    cfg = dict(fresh_config(head_dim, q.dtype, max_query_len, on_cpu), **(config or {}))
    if cfg["BLOCK_M"] % cfg["BLOCK_N"] != 0:
        raise ValueError(
            f"fresh_prefill_attention: BLOCK_M {cfg['BLOCK_M']} must be a multiple of BLOCK_N {cfg['BLOCK_N']}"
        )
    num_m_tiles = triton.cdiv(max_query_len, cfg["BLOCK_M"])
    _fresh_prefill_kernel[(num_q_heads, num_m_tiles, batch)](
        _descriptor(q, cfg["BLOCK_M"]),
        _descriptor(k, cfg["BLOCK_N"]),
        _descriptor(v, cfg["BLOCK_N"]),
        query_start_loc,
        out,
        scale * LOG2E,
        num_m_tiles,
        out.stride(0),
        out.stride(1),
        num_q_heads // k.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        NUM_STAGES=cfg["num_stages"],
        WARP_SPEC=cfg["WARP_SPEC"],
        DOT_F32=on_cpu,
        PREC=dot_precision(q.dtype),
        num_warps=cfg["num_warps"],
    )
    return out
