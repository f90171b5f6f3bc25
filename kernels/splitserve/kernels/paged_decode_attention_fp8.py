"""Paged decode attention over an fp8 (e4m3) cache: tile variants that keep the e4m3 bytes off the
byte-wise shared-memory path (docs/performance.md, "FP8").

Why: the upcast kernel (paged_decode_attention.py, `DOT_F16`) lets Triton stage the e4m3 tile in shared
memory and read it back into the 16-bit dot-operand layout, for V one byte at a time (Triton 3.6, sm_90,
128-token tile: 128 `LDS.U8` per thread, ~1,350 SASS instructions in the loop for 32 KiB of K + V, where
the bf16 kernel spends ~550 on the same bytes). Here each cache row is read as int32 words (4 e4m3 values,
16-byte vectors per thread), converted in registers by inline PTX, and only the 16-bit tile goes on to
the dots:

    variant      dots                                                  loop SASS / 32 KiB (sm_90)
    rows         S = q K^T, O += P V          (mma.sync, M = 16 padded heads)         ~700
    tokens       S^T = K q^T, O^T += V^T P^T  (wgmma, M = BLOCK_N tokens)            ~550
    tokens_qk8   tokens, S^T on e4m3 operands: wgmma reads K from shared memory as   ~460
                 stored, q quantized per head in the kernel (QK8 1: one e4m3 q;
                 QK8 2: q = hi + lo, two e4m3 dots, about a 16-bit q's error)

Conversions (`CONV`): 0 = `cvt.rn.f16x2.e4m3x2` (two values an instruction, the values themselves);
1 = integer operations (e4m3 bits << 7 are the f16 bits of value * 2^-8, the sign moved to bit 15: exact,
3 integer instructions a pair; the 2^8 is folded into the scales). CONV 1 yields the bytes of a word in
the order b0 b2 b1 b3, so tile column 4j + 1 holds head-dim index 4j + 2 and the other way round:
q is loaded and the output stored through that same permutation (`_column_source`), which leaves
q.k and the output unchanged. Under the interpreter (`INTERPRET`) the PTX is replaced by plain Triton
operations computing the same values and dots run in float32, so CPU tests check the tiling, the
column order and the scales; the PTX itself is checked on a GPU (tests on a GPU,
benchmarks/kernel_timings.py --sections fp8attn).

HEADS_PER_PROGRAM (HPP, "rows" only): one program reads HPP neighbouring KV heads, so each token's bytes come
in runs of HPP x head_dim (the cache is (block, token, head, dim): at fp8 one head's row is a single 128-byte
run, half a bf16 row's) and its query rows, HPP x the group, fill more of the dot's 16 rows instead of padding.
Tile rows are (token, head) pairs; a query row's scores outside its own head's rows are masked to -inf, so the
dots compute HPP x the products they keep (cheap beside the bytes: the tensor cores idle in this kernel).

Outputs and split-K partials are those of paged_decode_attention.py's `_decode_kernel` (its merge
kernel finishes a split launch). Program ids: (sequence, KV head, split), or with HEADS_FIRST
(KV head, sequence, split), so that programs running side by side read neighbouring heads' bytes of
the same cache rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.pdl import pdl_launch, pdl_prologue

# variant name -> (TOKENS_M, QK8); "upcast" is paged_decode_attention.py's own kernel
FP8_VARIANTS = {
    "rows": (False, 0),
    "tokens": (True, 0),
    "tokens_qk8": (True, 1),
    "tokens_qk8x2": (True, 2),
}


@triton.jit
def _byte_value(b):
    """An e4m3 byte (in an int32) -> its value as float16 (interpreter path)."""
    return b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _byte_shifted(b):
    """An e4m3 byte (in an int32) -> float16 of its value / 256, by moving bits (interpreter path)."""
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _words_to_f16(w, CONV: tl.constexpr, INTERPRET: tl.constexpr):
    """int32 words of 4 e4m3 bytes (b0 lowest) -> 4 float16 tensors x0..x3 (tile columns 4j + 0..3):
    CONV 0 the values of b0 b1 b2 b3; CONV 1 the values / 256 of b0 b2 b1 b3."""
    if INTERPRET:
        b0 = w & 0xFF
        b1 = (w >> 8) & 0xFF
        b2 = (w >> 16) & 0xFF
        b3 = (w >> 24) & 0xFF
        if CONV == 0:
            x0, x1, x2, x3 = _byte_value(b0), _byte_value(b1), _byte_value(b2), _byte_value(b3)
        else:
            x0, x1, x2, x3 = _byte_shifted(b0), _byte_shifted(b2), _byte_shifted(b1), _byte_shifted(b3)
    elif CONV == 0:
        # cvt.rn.f16x2.e4m3x2 d, h: the two bytes of h -> two f16 in d (low byte -> low half)
        x0, x1, x2, x3 = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 x, y;\n"
            "mov.b32 {lo, hi}, $4;\n"
            "cvt.rn.f16x2.e4m3x2 x, lo;\n"
            "cvt.rn.f16x2.e4m3x2 y, hi;\n"
            "mov.b32 {$0, $1}, x;\n"
            "mov.b32 {$2, $3}, y; }",
            "=h,=h,=h,=h,r",
            [w],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=1,
        )
    else:
        # bytes 0 and 2 (then 1 and 3) as the low bytes of two 16-bit halves whose high bytes repeat the
        # sign (prmt's sign mode); << 7 puts sign, exponent and mantissa where f16 keeps them, the mask
        # clears the sign's copy at bit 14 and the low half's spill into the high one
        x0, x1, x2, x3 = tl.inline_asm_elementwise(
            "{ .reg .b32 x, y;\n"
            "prmt.b32 x, $4, 0, 0xA280;\n"
            "shl.b32 x, x, 7;\n"
            "and.b32 x, x, 0xBF80BF80;\n"
            "mov.b32 {$0, $1}, x;\n"
            "prmt.b32 y, $4, 0, 0xB391;\n"
            "shl.b32 y, y, 7;\n"
            "and.b32 y, y, 0xBF80BF80;\n"
            "mov.b32 {$2, $3}, y; }",
            "=h,=h,=h,=h,r",
            [w],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=1,
        )
    return x0, x1, x2, x3


@triton.jit
def _words_tile_f16(w, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CONV: tl.constexpr, INTERPRET: tl.constexpr):
    """int32 words (GROUPS, ROWS, BLOCK_D // 4) of e4m3 rows -> the (BLOCK_N, BLOCK_D) float16 tile."""
    x0, x1, x2, x3 = _words_to_f16(w, CONV, INTERPRET)
    t = tl.join(tl.join(x0, x2), tl.join(x1, x3))  # (..., BLOCK_D // 4, 2, 2): [.., j, e, f] = x_(2e + f)
    return tl.reshape(t, (BLOCK_N, BLOCK_D))  # column 4j + i holds x_i


@triton.jit
def _tile_offsets(
    bt_row,
    n0,
    end,
    stride_b,
    stride_t,
    inner,
    PAGE: tl.constexpr,
    ROWS: tl.constexpr,
    GROUPS: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Offsets (GROUPS, R, W) of tokens n0 .. n0 + GROUPS * ROWS: ROWS consecutive tokens share a page,
    so each group reads one block-table entry; `inner` (R, W) is the loop-invariant part (R = ROWS * the heads
    a program reads)."""
    first = n0 + tl.arange(0, GROUPS) * ROWS  # (GROUPS,) first token of each group
    if MASKED:
        block_id = tl.load(bt_row + first // PAGE, mask=first < end, other=0)
    else:
        block_id = tl.load(bt_row + first // PAGE)
    base = block_id.to(tl.int64) * stride_b + (first % PAGE) * stride_t  # (GROUPS,)
    return base[:, None, None] + inner[None, :, :]


@triton.jit
def _tile_words(
    k_ptr,
    v_ptr,
    bt_row,
    n0,
    end,
    k_inner,
    v_inner,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    PAGE: tl.constexpr,
    ROWS: tl.constexpr,
    GROUPS: tl.constexpr,
    MASKED: tl.constexpr,
    HPP: tl.constexpr,
):
    """The K and V words (or K bytes) of tokens n0 .. n0 + GROUPS * ROWS, each (GROUPS, ROWS * HPP, W) (HPP heads'
    rows of each token, one after another), zeros past `end`."""
    k_offs = _tile_offsets(bt_row, n0, end, stride_kb, stride_kt, k_inner, PAGE, ROWS, GROUPS, MASKED)
    v_offs = _tile_offsets(bt_row, n0, end, stride_vb, stride_vt, v_inner, PAGE, ROWS, GROUPS, MASKED)
    if MASKED:
        token = n0 + (tl.arange(0, GROUPS) * ROWS)[:, None] + (tl.arange(0, ROWS * HPP) // HPP)[None, :]
        mask = (token < end)[:, :, None]
        kw = tl.load(k_ptr + k_offs, mask=mask, other=0.0)
        vw = tl.load(v_ptr + v_offs, mask=mask, other=0)
    else:
        kw = tl.load(k_ptr + k_offs)
        vw = tl.load(v_ptr + v_offs)
    return kw, vw


@triton.jit
def _attend_tile(
    kw,
    vw,
    n0,
    end,
    m,
    l,
    acc,
    q16,
    q8,
    q_lo8,
    scale_cols,
    lo_cols,
    row_head,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TOKENS_M: tl.constexpr,
    QK8: tl.constexpr,
    CONV: tl.constexpr,
    MASKED: tl.constexpr,
    INTERPRET: tl.constexpr,
    HPP: tl.constexpr,
):
    """One tile of online softmax: convert the words, scores, (m, l, acc) updated. TOKENS_M: l is (BLOCK_N,
    BLOCK_G) per-row partial sums and acc is O^T (BLOCK_D, BLOCK_G); otherwise l (BLOCK_G,), acc (BLOCK_G, BLOCK_D)."""
    v = _words_tile_f16(vw, BLOCK_N * HPP, BLOCK_D, CONV, INTERPRET)  # (BLOCK_N * HPP, BLOCK_D): (token, head) rows
    if QK8 != 0:  # e4m3 bytes as stored: the wgmma reads them from shared memory
        k = tl.reshape(kw, (BLOCK_N, BLOCK_D))
    else:
        k = _words_tile_f16(kw, BLOCK_N * HPP, BLOCK_D, CONV, INTERPRET)
    if INTERPRET:  # the interpreter's dots: float32
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        q16 = q16.to(tl.float32)
        q8 = q8.to(tl.float32)
        q_lo8 = q_lo8.to(tl.float32)
    n_mask = (n0 + tl.arange(0, BLOCK_N * HPP) // HPP) < end  # each tile row's token
    if TOKENS_M:
        if QK8 != 0:
            s = tl.dot(k, q8) * scale_cols[None, :]
            if QK8 == 2:
                s += tl.dot(k, q_lo8) * lo_cols[None, :]
        else:
            s = tl.dot(k, q16) * scale_cols[None, :]  # (BLOCK_N, BLOCK_G), log2 units
        if MASKED:
            s = tl.where(n_mask[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[None, :])
        l = l * alpha[None, :] + p
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p.to(v.dtype))  # (BLOCK_D, BLOCK_G)
    else:
        s = tl.dot(q16, tl.trans(k)) * scale_cols[:, None]  # (BLOCK_G, BLOCK_N * HPP)
        if HPP > 1:  # a query row scores only its own KV head's rows of the tile
            own = row_head[:, None] == (tl.arange(0, BLOCK_N * HPP) % HPP)[None, :]
            if MASKED:
                own = own & n_mask[None, :]
            s = tl.where(own, s, float("-inf"))
        elif MASKED:
            s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)  # (BLOCK_G, BLOCK_D)
    return m_new, l, acc


@triton.jit
def _column_source(c, CONV: tl.constexpr):
    """Head-dim index held by tile column c (CONV 1 swaps the middle two of every four)."""
    if CONV == 1:
        c = (c // 4) * 4 + (c % 2) * 2 + (c // 2) % 2
    return c


@triton.jit
def _quantize_columns(x, FP8_MAX: tl.constexpr):
    """Each column of x (fp32) to e4m3 with its own scale amax / FP8_MAX -> (x8, scale (cols,))."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX, 1.0e-30)
    return (x / scale[None, :]).to(tl.float8e4nv), scale


@triton.jit
def _decode_fp8_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    qk_scale,
    num_splits,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_od,
    group,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    TOKENS_M: tl.constexpr,
    QK8: tl.constexpr,
    CONV: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    PREFETCH: tl.constexpr,
    INTERPRET: tl.constexpr,
    HPP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    if HEADS_FIRST:
        kvh = tl.program_id(0) * HPP  # the first of this program's HPP KV heads
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1) * HPP
    split = tl.program_id(2)
    num_kv_heads = (tl.num_programs(0) if HEADS_FIRST else tl.num_programs(1)) * HPP
    seq_len = tl.load(seq_lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    c = tl.arange(0, BLOCK_D)
    head = kvh * group + g  # (BLOCK_G,) query heads of this program's KV heads
    g_mask = g < group * HPP
    row_head = g // group  # which of the program's KV heads each query row attends with
    v_col = _column_source(c, CONV)  # head-dim index of each V tile column
    q_col = c if QK8 else v_col  # K tiles: bytes as stored (QK8) or converted like V
    v_scale = 256.0 if CONV == 1 else 1.0  # CONV 1 tiles hold value / 256
    k_scale = 1.0 if QK8 else v_scale
    q_base = q_ptr + b * stride_qb
    if TOKENS_M:  # q^T (BLOCK_D, BLOCK_G)
        q = tl.load(q_base + head[None, :] * stride_qh + q_col[:, None] * stride_qd, mask=g_mask[None, :], other=0.0)
    else:  # q (BLOCK_G, BLOCK_D)
        q = tl.load(q_base + head[:, None] * stride_qh + q_col[None, :] * stride_qd, mask=g_mask[:, None], other=0.0)
    q = q.to(tl.float32)
    scale_cols = tl.full([BLOCK_G], qk_scale * k_scale, dtype=tl.float32)
    q8 = q  # (unused unless QK8)
    if QK8 != 0:
        q8, q8_scale = _quantize_columns(q, 448.0)
        if QK8 == 2:  # the remainder in a second e4m3 q: the pair holds q to about 2^-8 relative
            q_lo8, q_lo_scale = _quantize_columns(q - q8.to(tl.float32) * q8_scale[None, :], 448.0)
            lo_cols = scale_cols * q_lo_scale
        scale_cols = scale_cols * q8_scale
    q16 = q.to(tl.float16)

    q_lo8, lo_cols = (q_lo8, lo_cols) if QK8 == 2 else (q8, scale_cols)  # (unused unless QK8 2)
    m = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    if TOKENS_M:
        l = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)  # per-row partial sums, reduced after the loop
        acc = tl.zeros([BLOCK_D, BLOCK_G], dtype=tl.float32)  # O^T
    else:
        l = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    GROUPS: tl.constexpr = BLOCK_N // ROWS
    rr = tl.arange(0, ROWS * HPP)  # a group's tile rows: (token, head) pairs, heads fastest
    r = rr // HPP  # token in the group
    kvh_rows = kvh + rr % HPP
    j = tl.arange(0, BLOCK_D // 4)
    k_inner = (r * stride_kt + kvh_rows * stride_kh)[:, None] + (c[None, :] if QK8 != 0 else j[None, :])  # (R, W)
    v_inner = (r * stride_vt + kvh_rows * stride_vh)[:, None] + j[None, :]
    if PREFETCH:  # the next tile's words load into registers while this one computes (num_stages 1)
        kw, vw = _tile_words(
            k_ptr,
            v_ptr,
            bt_row,
            start,
            end,
            k_inner,
            v_inner,
            stride_kb,
            stride_kt,
            stride_vb,
            stride_vt,
            PAGE,
            ROWS,
            GROUPS,
            True,
            HPP,
        )
        for n0 in range(start, end, BLOCK_N):
            kw_next, vw_next = _tile_words(
                k_ptr,
                v_ptr,
                bt_row,
                n0 + BLOCK_N,
                end,
                k_inner,
                v_inner,
                stride_kb,
                stride_kt,
                stride_vb,
                stride_vt,
                PAGE,
                ROWS,
                GROUPS,
                True,
                HPP,
            )
            m, l, acc = _attend_tile(
                kw,
                vw,
                n0,
                end,
                m,
                l,
                acc,
                q16,
                q8,
                q_lo8,
                scale_cols,
                lo_cols,
                row_head,
                BLOCK_N,
                BLOCK_D,
                TOKENS_M,
                QK8,
                CONV,
                True,
                INTERPRET,
                HPP,
            )
            kw, vw = kw_next, vw_next
    else:  # whole tiles without masks, then the last partial tile (if any) with them
        full_end = start + (end - start) // BLOCK_N * BLOCK_N
        for MASKED in tl.static_range(2):
            for n0 in range(full_end if MASKED else start, end if MASKED else full_end, BLOCK_N):
                kw, vw = _tile_words(
                    k_ptr,
                    v_ptr,
                    bt_row,
                    n0,
                    end,
                    k_inner,
                    v_inner,
                    stride_kb,
                    stride_kt,
                    stride_vb,
                    stride_vt,
                    PAGE,
                    ROWS,
                    GROUPS,
                    MASKED,
                    HPP,
                )
                m, l, acc = _attend_tile(
                    kw,
                    vw,
                    n0,
                    end,
                    m,
                    l,
                    acc,
                    q16,
                    q8,
                    q_lo8,
                    scale_cols,
                    lo_cols,
                    row_head,
                    BLOCK_N,
                    BLOCK_D,
                    TOKENS_M,
                    QK8,
                    CONV,
                    MASKED,
                    INTERPRET,
                    HPP,
                )

    if TOKENS_M:
        l = tl.sum(l, axis=0)
        acc = tl.trans(acc)  # (BLOCK_G, BLOCK_D)
    acc = acc * v_scale
    if IS_SPLIT:
        # partials as _decode_kernel writes them: acc (B, Hq, S, BLOCK_D), (m, l) (B, Hq, S, 2), fp32
        row = (b * (num_kv_heads * group) + head) * num_splits + split  # (BLOCK_G,)
        tl.store(part_acc_ptr + row[:, None].to(tl.int64) * BLOCK_D + v_col[None, :], acc, mask=g_mask[:, None])
        tl.store(part_ml_ptr + row.to(tl.int64) * 2, m, mask=g_mask)
        tl.store(part_ml_ptr + row.to(tl.int64) * 2 + 1, l, mask=g_mask)
    else:
        l = tl.where(l == 0.0, 1.0, l)
        o = acc / l[:, None]
        tl.store(
            out_ptr + b * stride_ob + head[:, None] * stride_oh + v_col[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None],
        )


def check_fp8_variant(variant: str, k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> None:
    """Fail naming the variant when it cannot run: an fp8 cache, unit stride along head_dim, and a
    power-of-two head_dim >= 16."""
    if variant not in FP8_VARIANTS:
        raise ValueError(
            f"paged_decode_attention: VARIANT {variant!r} is not 'upcast' or one of {sorted(FP8_VARIANTS)}"
        )
    if k_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"paged_decode_attention: VARIANT {variant!r} reads float8_e4m3fn caches, got {k_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(
            f"paged_decode_attention: VARIANT {variant!r} needs unit stride along head_dim, got {k_cache.stride()} "
            f"and {v_cache.stride()}"
        )
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(
            f"paged_decode_attention: VARIANT {variant!r} needs a power-of-two head_dim >= 16, got {head_dim}"
        )


def launch_fp8_decode(grid_args, q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_ml, qk_scale, cfg):
    """Launch `_decode_fp8_kernel` for cfg["VARIANT"] (cfg also: BLOCK_N, num_warps, num_stages, and
    optionally CONV (0), HEADS_FIRST (False), PREFETCH (False: the next tile's words loaded into registers
    during this one, for num_stages 1), HEADS_PER_PROGRAM ("rows" only, default 1: KV heads one program reads,
    module docstring), BLOCK_G (query-head rows, default max(16, group x heads per program); "tokens" variants
    take 8: their heads are the dots' N side)). grid_args = (batch, num_kv_heads, num_splits, interpreting)."""
    batch, num_kv_heads, num_splits, on_cpu = grid_args
    tokens_m, qk8 = FP8_VARIANTS[cfg["VARIANT"]]
    heads_first = bool(cfg.get("HEADS_FIRST", False))
    k_view = k_cache if qk8 else k_cache.view(torch.int32)  # (N, bs, Hkv, D // 4) words, strides in words
    v_view = v_cache.view(torch.int32)
    group = q.shape[1] // num_kv_heads
    hpp = int(cfg.get("HEADS_PER_PROGRAM", 1))
    if hpp < 1 or num_kv_heads % hpp:
        raise ValueError(
            f"paged_decode_attention: HEADS_PER_PROGRAM {hpp} must be >= 1 and divide the {num_kv_heads} KV heads"
        )
    if hpp > 1 and tokens_m:
        raise ValueError(
            f"paged_decode_attention: HEADS_PER_PROGRAM {hpp} needs VARIANT 'rows', got {cfg['VARIANT']!r}"
        )
    rows = group * hpp  # query rows of a program
    block_g = cfg.get("BLOCK_G", max(16, 1 << (rows - 1).bit_length()))
    if block_g < rows:
        raise ValueError(f"paged_decode_attention: BLOCK_G {block_g} is below the {rows} query heads of a program")
    programs = num_kv_heads // hpp
    grid = (programs, batch, num_splits) if heads_first else (batch, programs, num_splits)
    _decode_fp8_kernel[grid](
        q,
        k_view,
        v_view,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_ml,
        qk_scale,
        num_splits,
        *q.stride(),
        *k_view.stride()[:3],
        *v_view.stride()[:3],
        block_tables.stride(0),
        *out.stride(),
        group,
        BLOCK_G=block_g,
        BLOCK_D=q.shape[2],
        PAGE=k_cache.shape[1],
        ROWS=min(cfg["BLOCK_N"], k_cache.shape[1] & -k_cache.shape[1]),
        BLOCK_N=cfg["BLOCK_N"],
        IS_SPLIT=num_splits > 1,
        TOKENS_M=tokens_m,
        QK8=qk8,
        CONV=int(cfg.get("CONV", 0)),
        HEADS_FIRST=heads_first,
        PREFETCH=bool(cfg.get("PREFETCH", False)),
        INTERPRET=on_cpu,
        HPP=hpp,
        **pdl_launch(q),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
