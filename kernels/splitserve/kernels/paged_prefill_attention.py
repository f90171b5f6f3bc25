"""Paged prefill attention: variable-length batches of new tokens, causal over the paged cache.

    q:               (T, Hq, D) the new tokens of all sequences, flattened
    query_start_loc: (B+1,) int32; sequence i owns q rows [qsl[i], qsl[i+1])
    seq_lens:        (B,) int32 context after this step (cached + new), all already in the cache
    block_tables:    (B, max_blocks) int32

    positions   0 ............ ctx=seq_len-q_len ........ seq_len-1
                |<--- cached --->|<------- new (q rows) ------>|
    new token j sits at position ctx + j and attends to keys 0..ctx+j

This one kernel covers a plain prefill (ctx = 0), a chunk of a long prompt, and a prefix-cache
hit (ctx = cached prefix). One program takes BLOCK_M query rows of one head of one sequence.
Keys before the tile's first row position are visible to every row and run without a mask; only
the last BLOCK_M keys or so need the causal mask. Tiles are launched longest-first (the last
query tile of a causal sequence has the most keys) to shorten the tail.

gpt-oss's extras: `sinks` (Hq,) adds each head's learned logit to the softmax's denominator (a term that weighs
no value), and `sliding_window` W hides keys more than W - 1 positions before a row (every tile then runs masked,
starting at the first key the tile's first row sees).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._common import (
    check_paged_attention_shapes,
    check_sinks_window,
    dot_precision,
    fp8_dot_f16,
    gather_sequence_kv,
    interpreting,
    next_pow2,
    use_triton,
)

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    acc,
    l,
    m,
    q,
    k_ptr,
    v_ptr,
    bt_row,
    kv_head,
    n0,
    offs_pos,
    seq_len,
    qk_scale,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    window,
    HAS_WINDOW: tl.constexpr,
):
    """One K/V tile of BLOCK_N tokens starting at n0: online-softmax update of (acc, l, m)."""
    n = n0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    d = tl.arange(0, BLOCK_D)
    if MASKED:
        n_mask = n < seq_len
        block_id = tl.load(bt_row + n // PAGE, mask=n_mask, other=0).to(tl.int64)
    else:
        block_id = tl.load(bt_row + n // PAGE).to(tl.int64)
    k_row = block_id * stride_kb + (n % PAGE) * stride_kt + kv_head * stride_kh
    v_row = block_id * stride_vb + (n % PAGE) * stride_vt + kv_head * stride_vh
    k_ptrs = k_ptr + k_row[None, :] + d[:, None] * stride_kd  # (BLOCK_D, BLOCK_N)
    v_ptrs = v_ptr + v_row[:, None] + d[None, :] * stride_vd  # (BLOCK_N, BLOCK_D)
    if MASKED:
        if HEAD_DIM == BLOCK_D:
            k = tl.load(k_ptrs, mask=n_mask[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=n_mask[None, :] & (d[:, None] < HEAD_DIM), other=0.0)
            v = tl.load(v_ptrs, mask=n_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    else:
        if HEAD_DIM == BLOCK_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d[:, None] < HEAD_DIM, other=0.0)
            v = tl.load(v_ptrs, mask=d[None, :] < HEAD_DIM, other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:  # an fp8 cache: upcast to q's dtype (its scale is folded into qk_scale by the caller)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = tl.dot(q, k, input_precision=PREC)  # (BLOCK_M, BLOCK_N) raw scores; * qk_scale -> log2 units
    if MASKED:
        visible = (n[None, :] <= offs_pos[:, None]) & n_mask[None, :]
        if HAS_WINDOW:
            visible = visible & (n[None, :] > offs_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1) * qk_scale)
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])  # one FMA per score
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return acc, l, m_new


# the step's tile count and block-table width change every step: specialized (== 1, a multiple of 16) each new
# class compiled a variant mid-serving, a pause of every running stream (docs/performance.md, "Findings that set
# defaults": eager kernels compiled before serving)
@triton.jit(do_not_specialize=["num_m_tiles", "stride_btb"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    qsl_ptr,
    seq_lens_ptr,
    out_ptr,
    sinks_ptr,
    qk_scale,
    window,
    num_m_tiles,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_btb,
    stride_ot,
    stride_oh,
    stride_od,
    group,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    SINGLE_LOOP: tl.constexpr,
    DOT_F16: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    head = tl.program_id(0)
    tile = num_m_tiles - 1 - tl.program_id(1)  # longest tiles first
    b = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 < q_len:
        seq_len = tl.load(seq_lens_ptr + b)
        ctx = seq_len - q_len  # tokens cached before this step
        offs_m = m0 + tl.arange(0, BLOCK_M)  # (BLOCK_M,) row index within the sequence's new tokens
        d = tl.arange(0, BLOCK_D)
        row_mask = (offs_m < q_len)[:, None] & (d < HEAD_DIM)[None, :]
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :] * stride_qd, mask=row_mask, other=0.0
        )  # (BLOCK_M, BLOCK_D)
        if DOT_F32:
            q = q.to(tl.float32)
        elif DOT_F16:  # fp8 cache: tiles upcast to f16 (one packed convert per two e4m3 values), q with them
            q = q.to(tl.float16)
        offs_pos = ctx + offs_m  # absolute position of each row
        kv_head = head // group
        bt_row = bt_ptr + b.to(tl.int64) * stride_btb
        m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # keys 0..ctx+m0 are visible to every row of the tile: whole tiles of them need no mask
        full_end = ((ctx + m0 + 1) // BLOCK_N) * BLOCK_N
        if SINGLE_LOOP:  # every tile through the masked loop: one pipeline prologue (short sequences)
            full_end = 0
        if HAS_WINDOW:  # every tile masked, from the tile holding the first key the tile's first row sees
            full_end = tl.maximum(ctx + m0 - window + 1, 0) // BLOCK_N * BLOCK_N
        causal_end = tl.minimum(seq_len, ctx + m0 + BLOCK_M)
        # unrolled at compile time: keys [0, full_end) without the causal mask, then [full_end, causal_end) with it
        for masked in tl.static_range(2):
            lo = full_end if masked else 0
            hi = causal_end if masked else full_end
            if HAS_WINDOW:  # keys before full_end are outside every row's window: no unmasked pass
                lo = full_end
            for n0 in range(lo, hi, BLOCK_N):
                acc, l, m = _attend_tile(
                    acc,
                    l,
                    m,
                    q,
                    k_ptr,
                    v_ptr,
                    bt_row,
                    kv_head,
                    n0,
                    offs_pos,
                    seq_len,
                    qk_scale,
                    stride_kb,
                    stride_kt,
                    stride_kh,
                    stride_kd,
                    stride_vb,
                    stride_vt,
                    stride_vh,
                    stride_vd,
                    HEAD_DIM,
                    BLOCK_D,
                    PAGE,
                    BLOCK_N,
                    masked,
                    DOT_F32,
                    PREC,
                    window,
                    HAS_WINDOW,
                )
        if HAS_SINKS:  # the sink's logit (log2 units) joins the running max and the denominator
            sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
            m_all = tl.maximum(m, sink)
            rescale = tl.exp2(m - m_all)
            acc = acc * rescale[:, None]
            l = l * rescale + tl.exp2(sink - m_all)
        o = acc / l[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty),
            mask=row_mask,
        )


# one query length per row-tile class of prefill_config (16, 32, 64 and 128 rows): a step's longest query picks
# its class, and compiling each class before serving is compiling every variant a step can launch
PREFILL_TILE_QUERY_LENS = (16, 32, 64, 1025)


def prefill_config(head_dim: int, dtype: torch.dtype, max_query_len: int, on_cpu: bool) -> dict:
    """Tile sizes and launch parameters for the prefill kernel."""
    if on_cpu:
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    # 128-row tiles for long prompts, 64 up to 1024 query tokens (more programs for short sequences); 4 warps
    # beat 8 with 64-wide K tiles (docs/performance.md, "Findings that set defaults": paged prefill tiles).
    block_m = 128 if max_query_len > 1024 else min(64, max(16, next_pow2(max_query_len)))
    if dtype == torch.float32 or head_dim > 128:
        return dict(BLOCK_M=min(block_m, 64), BLOCK_N=32, num_warps=4, num_stages=2)
    return dict(BLOCK_M=block_m, BLOCK_N=64, num_warps=4, num_stages=3)


def _check(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens) -> None:
    check_paged_attention_shapes("paged_prefill_attention", "(T, Hq, D)", q, k_cache, v_cache)
    batch = seq_lens.shape[0]
    if query_start_loc.shape != (batch + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"paged_prefill_attention: for {batch} sequences query_start_loc must be "
            f"({batch + 1},) and block_tables ({batch}, max_blocks), got "
            f"{tuple(query_start_loc.shape)} and {tuple(block_tables.shape)}"
        )


def paged_prefill_attention_ref(
    q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_query_len, scale, out=None, sinks=None,
    sliding_window=None,
):  # fmt: skip
    """Plain-torch reference (fp32 math), one sequence at a time; `sinks` / `sliding_window` as the module says."""
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    qsl = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[b], qsl[b + 1]
        if end == start:
            continue
        k, v = gather_sequence_kv(k_cache, v_cache, block_tables[b], seq_len)  # (L, Hkv, D) fp32
        qb = q[start:end].float().view(end - start, num_kv_heads, group, -1)  # (Lq, Hkv, G, D)
        scores = torch.einsum("qhgd,lhd->hgql", qb, k) * scale  # (Hkv, G, Lq, L)
        pos = torch.arange(end - start, device=q.device) + (seq_len - (end - start))  # (Lq,)
        cols = torch.arange(seq_len, device=q.device)[None, :]
        visible = cols <= pos[:, None]  # (Lq, L)
        if sliding_window is not None:
            visible &= cols > pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # one more logit per head, dropped after the softmax
            sink = sinks.float().view(num_kv_heads, group, 1, 1).expand(-1, -1, end - start, 1)
            scores = torch.cat((scores, sink), dim=-1)
        probs = scores.softmax(dim=-1)[..., :seq_len]
        o = torch.einsum("hgql,lhd->qhgd", probs, v)  # (Lq, Hkv, G, D)
        out[start:end] = o.reshape(end - start, num_q_heads, -1).to(out.dtype)
    return out


def paged_prefill_attention_triton(
    q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_query_len, scale, out=None, config=None,
    sinks=None, sliding_window=None,
):  # fmt: skip
    """Triton kernel; `config` overrides prefill_config (benchmarks and tests only)."""
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    batch = seq_lens.shape[0]
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0 or batch == 0 or max_query_len == 0:
        return out
    on_cpu = interpreting(q)
    cfg = dict(prefill_config(head_dim, q.dtype, max_query_len, on_cpu), **(config or {}))
    num_m_tiles = triton.cdiv(max_query_len, cfg["BLOCK_M"])
    _prefill_kernel[(num_q_heads, num_m_tiles, batch)](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        sinks if sinks is not None else out,
        scale * LOG2E,
        sliding_window or 0,
        num_m_tiles,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        *out.stride(),
        num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)),
        PAGE=block_size,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        DOT_F32=on_cpu,
        PREC=dot_precision(q.dtype),
        DOT_F16=fp8_dot_f16(q, k_cache),
        SINGLE_LOOP=cfg.get("SINGLE_LOOP", False),
        HAS_SINKS=sinks is not None,
        HAS_WINDOW=sliding_window is not None,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    impl: str = "auto",
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens q (T, Hq, D) over their sequences' caches -> (T, Hq, D).

    max_query_len: the longest q_len in the batch (sizes the grid; host int, no device sync).
    Rows of q outside every sequence's range are left untouched in `out`. sinks (Hq,) / sliding_window: gpt-oss's.
    """
    _check(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    check_sinks_window("paged_prefill_attention", q.shape[1], sinks, sliding_window)
    args = (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_query_len, scale)
    extras = dict(out=out, sinks=sinks, sliding_window=sliding_window)
    if use_triton(impl, q, "paged_prefill_attention"):
        return paged_prefill_attention_triton(*args, **extras)
    return paged_prefill_attention_ref(*args, **extras)
