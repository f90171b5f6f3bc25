"""y = x W^T (+ b) from block-scaled e4m3 operands (W8A8, the form of block-wise FP8 checkpoints).

    x_q (M, K) float8_e4m3fn, x_scale (M, K / G) fp32     activations: one scale per token per G features
    w_q (N, K) float8_e4m3fn, w_scale (N, K / G) fp32     weights: one scale per row per G features (a checkpoint's
                                                           bn x G tiles, each row given its tile's scale)
    y[m, n] = sum over groups g of (x_q[m, g] . w_q[n, g]) * x_scale[m, g] * w_scale[n, g]  (+ b[n])

Each program owns a (BLOCK_M, BLOCK_N) tile of y and walks K one group at a time (BLOCK_K = G): one e4m3 tensor-core
dot of the group's (BLOCK_M, G) x (G, BLOCK_N), its fp32 result scaled by the group's row and column scales and
added to the fp32 accumulator; the bias after the last group; one rounding to the output dtype. Programs are
ordered GROUP_M row tiles at a time, so neighbouring programs reuse the same weight tiles from L2.

A fixed grid per shape and no host sync (CUDA-graph safe). `supported` says which (K, G) it takes: G a power of two
in [32, 256] dividing K (tl.dot's and tl.arange's limits); engine.worker.fp8 runs its reference for others.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_GROUP, MAX_GROUP = 32, 256  # tl.dot of e4m3 operands needs K >= 32


@triton.jit
def _fp8_block_mm(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_asg,
    stride_bn,
    stride_bsn,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % rows_here
    tile_n = (pid % per_group) // rows_here
    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    m_in = m < M
    n_in = n < N
    a_rows = a_ptr + m.to(tl.int64)[:, None] * stride_am + k[None, :]  # (BLOCK_M, BLOCK_K)
    b_cols = b_ptr + n.to(tl.int64)[None, :] * stride_bn + k[:, None]  # (BLOCK_K, BLOCK_N): w_q^T's tile
    a_scales = a_scale_ptr + m.to(tl.int64) * stride_asm
    b_scales = b_scale_ptr + n.to(tl.int64) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_rows + g * BLOCK_K, mask=m_in[:, None], other=0.0)
        b = tl.load(b_cols + g * BLOCK_K, mask=n_in[None, :], other=0.0)
        sa = tl.load(a_scales + g * stride_asg, mask=m_in, other=0.0)
        sb = tl.load(b_scales + g, mask=n_in, other=0.0)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_in, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + m.to(tl.int64)[:, None] * stride_cm + n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


def supported(k: int, group: int) -> bool:
    """Whether the kernel takes K features in groups of `group` (a power of two in [32, 256] dividing K)."""
    return MIN_GROUP <= group <= MAX_GROUP and group & (group - 1) == 0 and k % group == 0


def block_config(m: int, n: int) -> dict:
    """Tile and launch parameters for M rows and N columns: the best of benchmarks/fp8_block_linear.py's sweep at
    Llama-3-8B's projections (docs/performance.md); wide N takes wider tiles."""
    wide = n >= 16384
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64 if wide else 32, GROUP_M=1, num_warps=4, num_stages=4)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=128 if wide else 64, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4)


def fp8_block_linear(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: dict | None = None,
) -> torch.Tensor:
    """(M, N) in `out_dtype` from x_q (M, K), x_scale (M, K / G), w_q (N, K), w_scale (N, K / G) (module docstring);
    `config` overrides block_config's keys (benchmarks)."""
    rows, k = x_q.shape
    n = w_q.shape[0]
    groups = x_scale.shape[1]
    if w_q.shape[1] != k or w_scale.shape != (n, groups) or x_scale.shape[0] != rows or k % groups:
        raise ValueError(
            f"fp8_block_linear: x_q {tuple(x_q.shape)}, x_scale {tuple(x_scale.shape)}, w_q {tuple(w_q.shape)} and "
            f"w_scale {tuple(w_scale.shape)} do not agree on (M, K, N, K / G)"
        )
    group = k // groups
    if not supported(k, group):
        raise ValueError(f"fp8_block_linear: groups of {group} features over K {k} (a power of two in [32, 256])")
    if x_q.stride(1) != 1 or w_q.stride(1) != 1 or w_scale.stride(1) != 1:
        raise ValueError("fp8_block_linear: the operands and the weight's scales need unit stride along K")
    out = torch.empty((rows, n), dtype=out_dtype, device=x_q.device)
    if rows == 0:
        return out
    cfg = dict(block_config(rows, n), **(config or {}))
    grid = (triton.cdiv(rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _fp8_block_mm[grid](
        x_q, x_scale, w_q, w_scale, bias if bias is not None else out, out,
        rows, n, k, x_q.stride(0), *x_scale.stride(), w_q.stride(0), w_scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_K=group, **cfg,
    )  # fmt: skip
    return out


def fp8_block_linear_ref(x_q, x_scale, w_q, w_scale, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """The kernel's math in torch: per group, the fp32 dot of the e4m3 values times both scales, summed over the
    groups, plus the bias, rounded once to `out_dtype`."""
    rows, k = x_q.shape
    groups = x_scale.shape[1]
    g = k // groups
    xs = x_q.float().view(rows, groups, g).transpose(0, 1)  # (groups, M, G)
    ws = w_q.float().view(-1, groups, g).transpose(0, 1)  # (groups, N, G)
    per_group = torch.bmm(xs, ws.transpose(1, 2))  # (groups, M, N)
    y = (per_group * x_scale.t()[:, :, None] * w_scale.t()[:, None, :]).sum(0)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
