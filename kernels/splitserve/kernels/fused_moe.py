"""Fused mixture-of-experts MLP: every token through its top-k SwiGLU experts, weighted and summed.

    x (T, H), w13 (E, 2F, H) = [gate | up] rows per expert, w2 (E, H, F),
    topk_ids (T, k) int, topk_weights (T, k)  ->  out (T, H) = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])

The Triton path runs in three launches, every shape fixed by (T, k, E, BLOCK_M), so a CUDA graph captures it
with no host sync:

 1. `moe_align_block_size`: the T*k (token, slot) pairs, numbered flat = t * k + j, sorted by expert, each
    expert's run padded to a multiple of BLOCK_M with the sentinel T*k; one expert per BLOCK_M block.

        sorted_ids   | e0 e0 e0 -- | e2 -- -- -- | e3 e3 e3 e3 | e3 -- -- -- | (unused tail)
        expert_ids   |     0       |     2       |     3       |     3       |
                                                  num_tokens_post_padded = 16 ^

 2. gate/up: a block's rows gather x[flat // k], one grouped GEMM against its expert's gate and up rows,
    SiLU-and-mul in the epilogue, stored at row `flat` of the (T*k, F) intermediate.
 3. down: those rows against the expert's w2, times the router weight of (t, j) in the epilogue, stored at
    row `flat` of (T*k, H); the k rows of a token are then summed (torch sums 16-bit values in float32).

gpt-oss's experts (`w13_bias` (E, 2F), `w2_bias` (E, H), `clamped_swiglu` = (alpha, limit)): each projection adds
its expert's bias in the epilogue (before the router weight), and the activation is
(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit) in place of silu(gate) * up;
`interleaved` reads w13's rows (and w13_bias) in gpt-oss's order g0, u0, g1, u1, ... instead of halves.

Blocks past `num_tokens_post_padded` return at once. The plain-torch reference loops over the experts hit,
as transformers' eager experts do; it is the CPU path and the tests' ground truth.

FP8 experts (W8A16): w13 and w2 in e4m3 with one float32 scale per expert and output row, w13_scale (E, 2F)
and w2_scale (E, H); the kernels upcast the weight tiles in registers and scale the fp32 sums in the epilogue
(the reference multiplies by the dequantized weights).
Tiles come from `tuned_configs` (op "fused_moe", modes "M<=<tokens>", shapes N=2F,K=H and N=H,K=F).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from splitserve.kernels._common import dot_precision, interpreting, next_pow2, use_triton
from splitserve.kernels.activation import _silu_mul
from splitserve.kernels.tuned_configs import tuned_configs

OP = "fused_moe"
DEFAULT_SMALL = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
DEFAULT_LARGE = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
_ALIGN_CHUNK = 256


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    clamped_swiglu: tuple[float, float] | None = None,
    interleaved: bool = False,
) -> torch.Tensor:
    """The plain-torch MoE: per expert hit (ascending), its tokens through SwiGLU (with the biases and the
    clamped activation when given), times their weights (in the weights' dtype, then cast to x's), added into
    the output (T, H). e4m3 experts are dequantized (times their per-row scales, in x's dtype) first."""
    if w13_scale is not None:
        w13 = (w13.to(torch.float32) * w13_scale[:, :, None]).to(x.dtype)  # (E, 2F, H)
        w2 = (w2.to(torch.float32) * w2_scale[:, :, None]).to(x.dtype)  # (E, H, F)
    out = torch.zeros_like(x)  # (T, H)
    half = w13.shape[1] // 2
    for expert in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == expert)  # (n,) each
        gate_up = F.linear(x[token], w13[expert], None if w13_bias is None else w13_bias[expert])  # (n, 2F)
        gate, up = (gate_up[:, 0::2], gate_up[:, 1::2]) if interleaved else (gate_up[:, :half], gate_up[:, half:])
        act = F.silu(gate) * up if clamped_swiglu is None else clamped_swiglu_ref(gate, up, *clamped_swiglu)
        h = F.linear(act, w2[expert], None if w2_bias is None else w2_bias[expert])  # (n, H)
        out.index_add_(0, token, (h * topk_weights[token, slot, None]).to(x.dtype))
    return out


def clamped_swiglu_ref(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    gate = gate.clamp(max=limit)
    return (up.clamp(min=-limit, max=limit) + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    clamped_swiglu: tuple[float, float] | None = None,
    interleaved: bool = False,
    impl: str = "auto",
    config: dict | None = None,
) -> torch.Tensor:
    """out (T, H) of the top-k experts (module docstring); `w13_scale` / `w2_scale`: the row scales of e4m3
    experts; `w13_bias` / `w2_bias` / `clamped_swiglu` (alpha, limit) / `interleaved` (w13's rows g0, u0, g1, u1,
    ...): gpt-oss's experts; `config`: tiles
    (BLOCK_M/N/K, num_warps, num_stages), else the tuned table's or the default."""
    _check(x, w13, w2, topk_weights, topk_ids)
    _check_scales(w13, w2, w13_scale, w2_scale)
    _check_biases(w13, w2, w13_bias, w2_bias)
    extras = dict(w13_bias=w13_bias, w2_bias=w2_bias, clamped_swiglu=clamped_swiglu, interleaved=interleaved)
    if not use_triton(impl, x, OP):
        return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, **extras)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()  # the kernels assume unit last strides
    num_tokens, top_k = topk_ids.shape
    num_experts, two_f, hidden = w13.shape
    up_config = config or choose_config(x, num_tokens, two_f, hidden)
    down_config = config or choose_config(x, num_tokens, hidden, two_f // 2)
    block_m = up_config["BLOCK_M"]
    if down_config["BLOCK_M"] != block_m:  # one alignment serves both GEMMs
        down_config = {**down_config, "BLOCK_M": block_m}
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, block_m, num_experts)
    inter = torch.empty(num_tokens * top_k, two_f // 2, dtype=x.dtype, device=x.device)  # (T*k, F)
    align = (sorted_ids, expert_ids, num_post)
    _grouped_gemm(x, w13, w13_scale, w13_bias, inter, *align, top_k, None, up_config, clamped_swiglu, interleaved)
    down = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)  # (T*k, H)
    _grouped_gemm(inter, w2, w2_scale, w2_bias, down, *align, 1, topk_weights.reshape(-1), down_config)
    return down.view(num_tokens, top_k, hidden).sum(1)  # (T, H), summed in float32 and rounded once


def _check(x, w13, w2, topk_weights, topk_ids) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"{OP}: x must be (T, H), w13 (E, 2F, H), w2 (E, H, F); got {tuple(x.shape)}, "
            f"{tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    num_experts, two_f, hidden = w13.shape
    if two_f % 2 or x.shape[1] != hidden or tuple(w2.shape) != (num_experts, hidden, two_f // 2):
        raise ValueError(
            f"{OP}: shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} "
            "(need x (T, H), w13 (E, 2F, H), w2 (E, H, F))"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"{OP}: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
            f"(T, k) with T = {x.shape[0]}"
        )


def _check_scales(w13, w2, w13_scale, w2_scale) -> None:
    fp8 = w13.dtype == torch.float8_e4m3fn
    if fp8 != (w2.dtype == torch.float8_e4m3fn) or fp8 != (w13_scale is not None) or fp8 != (w2_scale is not None):
        raise ValueError(
            f"{OP}: e4m3 experts need both weights in e4m3 and both scales; got w13 {w13.dtype}, w2 {w2.dtype}, "
            f"w13_scale {_shape_of(w13_scale)}, w2_scale {_shape_of(w2_scale)}"
        )
    if fp8 and (tuple(w13_scale.shape) != tuple(w13.shape[:2]) or tuple(w2_scale.shape) != tuple(w2.shape[:2])):
        raise ValueError(
            f"{OP}: scales must be w13_scale {tuple(w13.shape[:2])} and w2_scale {tuple(w2.shape[:2])}, got "
            f"{tuple(w13_scale.shape)} and {tuple(w2_scale.shape)}"
        )


def _check_biases(w13, w2, w13_bias, w2_bias) -> None:
    for name, bias, want in (("w13_bias", w13_bias, w13.shape[:2]), ("w2_bias", w2_bias, w2.shape[:2])):
        if bias is not None and tuple(bias.shape) != tuple(want):
            raise ValueError(f"{OP}: {name} must be {tuple(want)} (E, rows of its weight), got {tuple(bias.shape)}")


def _shape_of(t: torch.Tensor | None) -> str:
    return "None" if t is None else str(tuple(t.shape))


def choose_config(x: torch.Tensor, num_tokens: int, n: int, k: int) -> dict:
    """Tiles for a (tokens, N=n, K=k) grouped GEMM: the device's tuned table (the smallest bucket
    'M<=m' holding num_tokens), else a default for few or many tokens."""
    if x.is_cuda:
        table = _device_table(x.device.index or 0, str(x.dtype).removeprefix("torch."))
        buckets = sorted((m, shapes) for m, shapes in table if m >= num_tokens)
        for _, shapes in buckets:
            if (n, k) in shapes:
                return dict(shapes[(n, k)])
    return dict(DEFAULT_SMALL if num_tokens <= 32 else DEFAULT_LARGE)


@functools.cache
def _device_table(device_index: int, dtype: str) -> tuple[tuple[int, dict], ...]:
    """((bucket tokens, {(N, K): tiles}), ...) of this device's tuned file ({} modes: none)."""
    name = torch.cuda.get_device_name(device_index)
    modes = tuned_configs(OP, name, "w16a16" if dtype in ("bfloat16", "float16") else dtype)
    return tuple((int(mode.removeprefix("M<=")), shapes) for mode, shapes in modes.items())


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids (P,) int32, expert_ids (P / block_m,) int32, num_tokens_post_padded (1,) int32) with
    P = the most padded rows T*k pairs can need; one launch, shapes fixed by (T*k, block_m, E)."""
    num_pairs = topk_ids.numel()
    max_padded = -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m) * block_m
    device = topk_ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_padded // block_m, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    _align_kernel[(num_experts,)](
        topk_ids.reshape(-1),
        sorted_ids,
        expert_ids,
        num_post,
        num_pairs,
        BLOCK_M=block_m,
        NUM_BINS=next_pow2(num_experts + 1),
        CHUNK=_ALIGN_CHUNK,
    )
    return sorted_ids, expert_ids, num_post


@triton.jit
def _align_kernel(
    ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    num_post_ptr,
    num_pairs,
    BLOCK_M: tl.constexpr,
    NUM_BINS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Program e: counts every expert's pairs (to find where e's run starts), then writes e's pairs in
    flat order, its padding and its blocks' expert id; program 0 also writes the padded total."""
    expert = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):  # masked lanes count in the unused bin NUM_BINS - 1
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < num_pairs, other=NUM_BINS - 1).to(tl.int32)
        counts += tl.histogram(ids, NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    padded = tl.where(bins < NUM_BINS - 1, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    run_start = tl.sum(tl.where(bins < expert, padded, 0))
    run_padded = tl.sum(tl.where(bins == expert, padded, 0))
    run_count = tl.sum(tl.where(bins == expert, counts, 0))
    if expert == 0:
        tl.store(num_post_ptr, tl.sum(padded))
    seen = 0
    for start in range(0, num_pairs, CHUNK):
        flat = start + offs
        ids = tl.load(ids_ptr + flat, mask=flat < num_pairs, other=-1)
        mine = (ids == expert).to(tl.int32)
        rank = seen + tl.cumsum(mine, 0) - 1
        tl.store(sorted_ptr + run_start + rank, flat.to(tl.int32), mask=mine == 1)
        seen += tl.sum(mine)
    for pad in range(run_count, run_padded, CHUNK):
        rows = pad + offs
        tl.store(sorted_ptr + run_start + rows, tl.zeros([CHUNK], dtype=tl.int32) + num_pairs, mask=rows < run_padded)
    for block in range(run_start // BLOCK_M, (run_start + run_padded) // BLOCK_M):
        tl.store(expert_ids_ptr + block, expert)


def _grouped_gemm(
    a, w, w_scale, bias, out, sorted_ids, expert_ids, num_post, pairs_per_a_row, row_scale, config, clamped=None,
    interleaved=False,
) -> None:  # fmt: skip
    """out[flat] = epilogue(a[flat // pairs_per_a_row] @ w[e]^T (* w_scale[e], e4m3 w) (+ bias[e])) for every
    sorted row: SiLU-and-mul (or the clamped SwiGLU of `clamped` = (alpha, limit)) of the [gate | up] halves
    when row_scale is None (rows g0, u0, g1, u1, ... when `interleaved`), else times row_scale[flat]."""
    silu_mul = row_scale is None
    n_out = w.shape[1] // 2 if silu_mul else w.shape[1]
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    grid = (sorted_ids.numel() // block_m, triton.cdiv(n_out, block_n))
    _grouped_gemm_kernel[grid](
        a,
        w,
        out,
        row_scale if row_scale is not None else out,
        w_scale if w_scale is not None else out,
        bias if bias is not None else out,
        sorted_ids,
        expert_ids,
        num_post,
        out.shape[0],
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        0 if w_scale is None else w_scale.stride(0),
        0 if bias is None else bias.stride(0),
        float(clamped[0]) if clamped else 0.0,
        float(clamped[1]) if clamped else 0.0,
        PAIRS_PER_A_ROW=pairs_per_a_row,
        N=n_out,
        K=w.shape[2],
        SILU_MUL=silu_mul,
        W_FP8=w_scale is not None,
        HAS_BIAS=bias is not None,
        CLAMPED=clamped is not None,
        INTERLEAVED=interleaved and silu_mul,
        UPCAST=interpreting(a) and (a.dtype == torch.bfloat16 or w_scale is not None),
        PRECISION=dot_precision(a.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=config["BLOCK_K"],
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, scale_ptr, w_scale_ptr, bias_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs,
    stride_a, stride_we, stride_wn, stride_out, stride_se, stride_be, alpha, limit,
    PAIRS_PER_A_ROW: tl.constexpr, N: tl.constexpr, K: tl.constexpr, SILU_MUL: tl.constexpr, W_FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, INTERLEAVED: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    flat = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # (BM,)
    valid = flat < num_pairs
    a_rows = flat // PAIRS_PER_A_ROW
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    col_ok = cols < N
    if INTERLEAVED:  # w13 rows g0, u0, g1, u1, ... (gpt-oss's checkpoint order)
        gate_rows = 2 * cols
        up_rows = 2 * cols + 1
    else:  # [gate | up] halves (or the down projection's plain rows)
        gate_rows = cols
        up_rows = cols + N
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = tl.load(w_base + gate_rows[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)  # (BK, BN)
        if UPCAST:
            a = a.to(tl.float32)
        w = w.to(a.dtype)  # e4m3 upcast in registers (a no-op for 16-bit weights)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if SILU_MUL:
            w_up = tl.load(w_base + up_rows[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
            acc_up = tl.dot(a, w_up.to(a.dtype), acc_up, input_precision=PRECISION)
    if W_FP8:  # the per-row scales of this expert's weight, after the sums
        scale_base = w_scale_ptr + expert * stride_se
        acc = acc * tl.load(scale_base + gate_rows, mask=col_ok, other=0.0)[None, :]
        if SILU_MUL:
            acc_up = acc_up * tl.load(scale_base + up_rows, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:  # this expert's bias of each output row, before the activation or the router weight
        bias_base = bias_ptr + expert * stride_be
        acc += tl.load(bias_base + gate_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc_up += tl.load(bias_base + up_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ty = out_ptr.dtype.element_ty
    if SILU_MUL and CLAMPED:  # gpt-oss: each projection rounded to the dtype, then the clamped SwiGLU in fp32
        gate = tl.minimum(acc.to(out_ty).to(tl.float32), limit)
        up = tl.minimum(tl.maximum(acc_up.to(out_ty).to(tl.float32), -limit), limit)
        result = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    elif SILU_MUL:  # as eager torch: each projection rounded to the dtype, then silu(gate) * up
        result = _silu_mul(acc.to(out_ty), acc_up.to(out_ty))
    else:  # the router weight of this (token, slot), in float32
        result = acc * tl.load(scale_ptr + flat, mask=valid, other=0.0).to(tl.float32)[:, None]
    out_mask = valid[:, None] & col_ok[None, :]
    tl.store(out_ptr + flat[:, None] * stride_out + cols[None, :], result.to(out_ty), mask=out_mask)
