"""Paged decode attention: one query token per sequence against its cached keys/values.

    q:            (B, Hq, D)        the current token of each sequence
    k/v_cache:    (num_blocks, block_size, Hkv, D), strided views of the block-major KV tensor
    block_tables: (B, max_blocks) int32; token n of sequence b lives in block
                  block_tables[b, n // block_size] at offset n % block_size
    seq_lens:     (B,) int32, context length including the current token (already written)

One program handles one (sequence, KV head, split): the Hq / Hkv query heads that share the KV
head are packed into the rows of one tile, so each K/V element is read from memory once
(GQA/MQA). With split-K (flash decoding) each sequence's context is cut into `num_splits`
contiguous ranges processed in parallel; a second kernel merges the partial softmax results:

    split s -> (acc_s = sum_n exp2(x_n - m_s) v_n,  l_s = sum_n exp2(x_n - m_s),  m_s)
    out     = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,   M = max_s m_s

Scores are kept in log2 units (x = q.k * scale * log2(e)) so the kernel uses exp2.
A sequence with seq_len 0 (batch padding) gets a zero output.

gpt-oss's extras. `sinks` (Hq,): each head's learned logit joins the softmax's denominator only (it weighs no
value); it enters once, where the partials meet: after the loop without split-K, in the merge with it
(M = max(M, sink), denominator + 2^(sink - M)). `sliding_window` W: the query at position p = seq_len - 1 sees
keys in (p - W, p], so the splits cut [max(seq_len - W, 0), seq_len) instead of [0, seq_len): blocks wholly
outside the window are never read, and every key a split reads is visible (no mask beyond the tail).
Both run only in the upcast kernel (any cache dtype, fp8 included); the fp8 variants take neither.
The caches may be float8_e4m3fn (half the bytes): tiles are upcast after loading, to float16 with
q cast to float16 too (DOT_F16: one packed e4m3 -> f16 convert per two values; bf16 would need a
second convert for each); any cache scale is the caller's (fold k's into `scale`, multiply the
output by v's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels import paged_decode_attention_fp8_mma as fp8_mma
from splitserve.kernels._common import (
    check_paged_attention_shapes,
    check_sinks_window,
    dot_precision,
    fp8_dot_f16,
    gather_sequence_kv,
    interpreting,
    next_pow2,
    num_sms,
    use_triton,
)
from splitserve.kernels.paged_decode_attention_fp8 import check_fp8_variant, launch_fp8_decode
from splitserve.kernels.paged_decode_config import choose_num_splits, extras_config, resolve_config
from splitserve.kernels.pdl import pdl_launch, pdl_prologue

LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    sinks_ptr,
    qk_scale,
    window,
    num_splits,
    stride_qb,
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
    stride_ob,
    stride_oh,
    stride_od,
    group,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F16: tl.constexpr,
    PDL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    first = 0  # the first key the query sees
    if HAS_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    head = kvh * group + g  # (BLOCK_G,) query heads of this KV head
    g_mask = g < group
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BLOCK_G, BLOCK_D)
    if DOT_F32:
        q = q.to(tl.float32)
    elif DOT_F16:  # fp8 cache: e4m3 -> f16 is one packed convert per two values, -> bf16 takes one more each
        q = q.to(tl.float16)

    m = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,) token positions
        n_mask = n < end
        block_id = tl.load(bt_row + n // PAGE, mask=n_mask, other=0).to(tl.int64)
        k_row = block_id * stride_kb + (n % PAGE) * stride_kt + kvh * stride_kh  # (BLOCK_N,)
        v_row = block_id * stride_vb + (n % PAGE) * stride_vt + kvh * stride_vh
        if HEAD_DIM == BLOCK_D:  # no column mask: keeps the loads vectorized
            k_mask = n_mask[None, :]
            v_mask = n_mask[:, None]
        else:
            k_mask = n_mask[None, :] & d_mask[:, None]
            v_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + k_row[None, :] + d[:, None] * stride_kd, mask=k_mask, other=0.0)  # (BLOCK_D, BLOCK_N)
        v = tl.load(v_ptr + v_row[:, None] + d[None, :] * stride_vd, mask=v_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:  # an fp8 cache: upcast to q's dtype (its scale is folded into qk_scale by the caller)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, k, input_precision=PREC) * qk_scale  # (BLOCK_G, BLOCK_N), log2 units
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if IS_SPLIT:
        # partials: acc (B, Hq, S, BLOCK_D) fp32, (m, l) (B, Hq, S, 2) fp32
        row = (b * (tl.num_programs(1) * group) + head) * num_splits + split  # (BLOCK_G,)
        tl.store(part_acc_ptr + row[:, None].to(tl.int64) * BLOCK_D + d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + row.to(tl.int64) * 2, m, mask=g_mask)
        tl.store(part_ml_ptr + row.to(tl.int64) * 2 + 1, l, mask=g_mask)
    else:
        if HAS_SINKS:  # the sink's logit (log2 units) joins the running max and the denominator
            sink = tl.load(sinks_ptr + head, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
            m_all = tl.maximum(m, sink)
            rescale = tl.exp2(m - m_all)
            acc = acc * rescale[:, None]
            l = l * rescale + tl.exp2(sink - m_all)
        l = tl.where(l == 0.0, 1.0, l)
        o = acc / l[:, None]
        tl.store(
            out_ptr + b * stride_ob + head[:, None] * stride_oh + d[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    sinks_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    stride_od,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    row = (b * NUM_HEADS + h).to(tl.int64) * num_splits + s  # (BLOCK_S,)
    m = tl.load(part_ml_ptr + row * 2, mask=s_mask, other=-1.0e30)
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)
    acc = tl.load(
        part_acc_ptr + row[:, None] * BLOCK_D + d[None, :], mask=s_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0
    )  # (BLOCK_S, BLOCK_D)
    m_max = tl.max(m, axis=0)
    if HAS_SINKS:  # the one place the sink enters: a term of the denominator, no value
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    w = tl.exp2(m - m_max)  # (BLOCK_S,)
    denom = tl.sum(w * l, axis=0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m_max)
    denom = tl.where(denom == 0.0, 1.0, denom)
    o = tl.sum(acc * w[:, None], axis=0) / denom  # (BLOCK_D,)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d * stride_od, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _check(q, k_cache, v_cache, block_tables, seq_lens) -> None:
    check_paged_attention_shapes("paged_decode_attention", "(B, Hq, D)", q, k_cache, v_cache)
    batch = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(
            f"paged_decode_attention: block_tables must be ({batch}, max_blocks) and seq_lens "
            f"({batch},), got {tuple(block_tables.shape)} and {tuple(seq_lens.shape)}"
        )


def paged_decode_attention_ref(
    q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, sinks=None, sliding_window=None
):
    """Plain-torch reference (fp32 math), one sequence at a time; `sinks` / `sliding_window` as the module says."""
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            out[b] = 0
            continue
        k, v = gather_sequence_kv(k_cache, v_cache, block_tables[b], seq_len)  # (L, Hkv, D) fp32
        qb = q[b].float().view(num_kv_heads, group, -1)  # (Hkv, G, D)
        scores = torch.einsum("hgd,lhd->hgl", qb, k) * scale  # (Hkv, G, L)
        if sliding_window is not None:  # the query at seq_len - 1 sees the last `sliding_window` keys
            scores[..., : max(seq_len - sliding_window, 0)] = float("-inf")
        if sinks is not None:  # one more logit per head, dropped after the softmax
            scores = torch.cat((scores, sinks.float().view(num_kv_heads, group, 1)), dim=-1)
        probs = scores.softmax(dim=-1)[..., :seq_len]
        out[b] = torch.einsum("hgl,lhd->hgd", probs, v).reshape(num_q_heads, -1).to(out.dtype)
    return out


def _launch_upcast(
    q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_ml, scale, num_splits, cfg, on_cpu, extras
):
    """`_decode_kernel`: any cache dtype; an fp8 cache's tiles upcast after loading (VARIANT "upcast").
    extras: (sinks or None, sliding_window or None)."""
    sinks, window = extras
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_ml,
        out if sinks is None else sinks,
        scale * LOG2E,
        window or 0,
        num_splits,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        *out.stride(),
        group,
        BLOCK_G=max(16, next_pow2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)),
        PAGE=block_size,
        BLOCK_N=cfg["BLOCK_N"],
        IS_SPLIT=num_splits > 1,
        DOT_F32=on_cpu,
        PREC=dot_precision(q.dtype),
        DOT_F16=cfg.get("DOT_F16", fp8_dot_f16(q, k_cache)),
        **pdl_launch(q),
        HAS_SINKS=sinks is not None,
        HAS_WINDOW=window is not None,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


def _launch_triton(
    q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_ml, scale, num_splits, cfg, on_cpu,
    extras=(None, None),
):  # fmt: skip
    """The Triton kernel `cfg` names: the upcast kernel, or one of paged_decode_attention_fp8's variants."""
    variant = cfg.get("VARIANT", "upcast")
    if variant == "upcast":
        _launch_upcast(
            q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_ml, scale, num_splits, cfg, on_cpu, extras
        )
        return
    check_fp8_variant(variant, k_cache, v_cache, q.shape[2])
    grid_args = (q.shape[0], k_cache.shape[2], num_splits, on_cpu)
    launch_fp8_decode(
        grid_args, q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_ml, scale * LOG2E, cfg
    )


def paged_decode_attention_triton(
    q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, num_splits=None, config=None, sinks=None,
    sliding_window=None,
):  # fmt: skip
    """Triton kernels, or for an e4m3 cache on a GPU of capability >= 8.9 the CUDA kernel of
    paged_decode_attention_fp8_mma (VARIANT "mma", the default there when it takes the operands). `config`
    overrides the choice (benchmarks and tests only): VARIANT "mma", "upcast" or one of
    paged_decode_attention_fp8.FP8_VARIANTS, with their options (decode_config's default for an fp8 cache the
    mma kernel cannot take: "rows"; resolve_config says what an override gives). With `sinks` or
    `sliding_window` the upcast kernel runs, whatever the cache (module docstring)."""
    batch, num_q_heads, head_dim = q.shape
    num_blocks_total, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    on_cpu = interpreting(q)
    sms = 4 if on_cpu else num_sms(q.device.index or 0)
    max_context = block_tables.shape[1] * block_size  # the table's width: an upper bound on every length
    if sliding_window is not None:  # a window bounds the keys any split reads
        max_context = min(max_context, sliding_window)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, sms)
    mma_operands = (q, k_cache, v_cache, out, block_tables, seq_lens)
    extras = (sinks, sliding_window)
    if sinks is not None or sliding_window is not None:
        cfg = extras_config(head_dim, q.dtype, on_cpu, k_cache, v_cache, config)
    elif config is not None:
        cfg = resolve_config(head_dim, q.dtype, on_cpu, k_cache, v_cache, config)
        if cfg.get("VARIANT") == "mma":  # asked for by name: what it cannot run is named
            why = fp8_mma.supports(*mma_operands) or (None if fp8_mma.available(q.device) else "no e4m3 mma here")
            if why:
                raise ValueError(f"paged_decode_attention: VARIANT 'mma' cannot run: {why}")
    elif (
        not on_cpu
        and fp8_mma.runs(*mma_operands)
        and fp8_mma.pays(batch * num_kv_heads * num_splits, sms, max_context // num_splits)
    ):
        cfg = dict(VARIANT="mma")  # an e4m3 cache on a GPU that can: 1.4-1.5x "rows" (docs/performance.md)
    else:
        cfg = resolve_config(head_dim, q.dtype, on_cpu, k_cache, v_cache)
    block_d = max(16, next_pow2(head_dim))
    is_split = num_splits > 1
    if is_split:
        part_acc = torch.empty(batch * num_q_heads * num_splits * block_d, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(batch * num_q_heads * num_splits * 2, device=q.device, dtype=torch.float32)
    else:
        part_acc = part_ml = out  # unused
    launch = (q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_ml)
    if cfg.get("VARIANT") == "mma":
        try:
            fp8_mma.launch_fp8_mma(*launch, scale * LOG2E, num_splits, cfg)
        except fp8_mma.CompileError:
            if config is not None:  # asked for by name: say so
                raise
            _launch_triton(
                *launch, scale, num_splits, resolve_config(head_dim, q.dtype, on_cpu, k_cache, v_cache), on_cpu
            )
    else:
        _launch_triton(*launch, scale, num_splits, cfg, on_cpu, extras)
    if is_split:
        _merge_splits_kernel[(batch, num_q_heads)](
            part_acc,
            part_ml,
            out,
            out if sinks is None else sinks,
            num_splits,
            *out.stride(),
            NUM_HEADS=num_q_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=max(2, next_pow2(num_splits)),
            **pdl_launch(out),
            HAS_SINKS=sinks is not None,
            num_warps=4,
        )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    impl: str = "auto",
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of q (B, Hq, D) over each sequence's first seq_lens[b] cached tokens -> (B, Hq, D).

    num_splits: split-K factor (None: choose_num_splits); ignored by the reference.
    sinks (Hq,) / sliding_window: gpt-oss's (module docstring).
    Math in fp32, output in q's dtype (or written into `out`).
    """
    _check(q, k_cache, v_cache, block_tables, seq_lens)
    check_sinks_window("paged_decode_attention", q.shape[1], sinks, sliding_window)
    args = (q, k_cache, v_cache, block_tables, seq_lens, scale)
    extras = dict(out=out, sinks=sinks, sliding_window=sliding_window)
    if use_triton(impl, q, "paged_decode_attention"):
        return paged_decode_attention_triton(*args, num_splits=num_splits, **extras)
    return paged_decode_attention_ref(*args, **extras)
