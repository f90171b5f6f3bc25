"""y = prologue(x) W^T (+ b) for a few rows (decode batches): the weight streamed once, with the op in
front of the projection computed on the fly from x instead of in a launch of its own.

    prologue "none":  a = x                                                    x (M, K)
    prologue "norm":  h = x (+ residual), a = RMSNorm(h) * norm_weight          x (M, K); writes h if residual
    prologue "silu":  a = silu(x[:, :K]) * x[:, K:]                             x (M, 2K) = [gate | up]
    y = a W^T (+ b)                                                             W (N, K) -> y (M, N)

Numerics are those of the unfused ops (`rmsnorm`, `activation`): the prologue rounds to x's dtype
where they do, the product accumulates in fp32 and rounds once. One program owns BLOCK_N output
columns for all M rows (padded to a 16-row tensor-core tile), so every weight byte is read once;
the norm's sum of squares is one extra pass over x (K values per row, from L2) in every program.

Why: at batch 1 an 8B model's decode step is ~350 launches; cuBLAS adds a split-K reduce to each
small-M GEMM and the norm and SiLU-mul are launches of their own (docs/perf.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._common import dot_precision, interpreting, use_triton

PROLOGUES = {"none": 0, "norm": 1, "silu": 2}
MAX_ROWS = 16  # one tensor-core tile of rows; more rows belong to a real GEMM


@triton.jit
def _prologue(
    x_ptr,
    res_ptr,
    res_out_ptr,
    nw_ptr,
    rows,
    m_mask,
    kk,
    k_mask,
    rstd,
    write_res,
    stride_xm,
    stride_rm,
    stride_rom,
    K: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """The (BLOCK_M, BLOCK_K) tile of the projection's input for columns kk, in x's dtype."""
    mask = m_mask[:, None] & k_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=mask, other=0.0)
    if PROLOGUE == 1:
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rows[:, None] * stride_rm + kk[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            res_mask = write_res[:, None] & k_mask[None, :]
            tl.store(res_out_ptr + rows[:, None] * stride_rom + kk[None, :], x, mask=res_mask)
        w = tl.load(nw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
        x = (normed.to(tl.float32) * w[None, :]).to(x.dtype)
    elif PROLOGUE == 2:
        up = tl.load(x_ptr + rows[:, None] * stride_xm + K + kk[None, :], mask=mask, other=0.0)
        g = x.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(x.dtype)
        x = (act.to(tl.float32) * up.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _skinny_linear_kernel(
    x_ptr,
    res_ptr,
    res_out_ptr,
    nw_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    eps,
    stride_xm,
    stride_rm,
    stride_rom,
    stride_wn,
    stride_ym,
    K: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PRO_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    # The prologue runs on PRO_ROWS rows: 1 for a single-row input (a decode at batch 1), whose tile
    # is then widened to the BLOCK_M rows the tensor-core dot takes; computing it on all 16 padded
    # rows made the fused SiLU projection 4x slower than the two launches it replaces (docs/perf.md).
    rows = tl.arange(0, PRO_ROWS)
    m_mask = rows < M
    all_rows = tl.arange(0, BLOCK_M)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    rstd = tl.zeros([PRO_ROWS], dtype=tl.float32)
    if PROLOGUE == 1:  # the norm needs each row's sum of squares before its first product
        ss = tl.zeros([PRO_ROWS], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            mask = m_mask[:, None] & (kk < K)[None, :]
            h = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + rows[:, None] * stride_rm + kk[None, :], mask=mask, other=0.0)
                h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
            hf = h.to(tl.float32)
            ss += tl.sum(hf * hf, axis=1)
        rstd = tl.rsqrt(ss / K + eps)
    write_res = m_mask & (tl.full([PRO_ROWS], pid, tl.int32) == 0)  # program 0 writes the new residual
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < K
        a = _prologue(
            x_ptr,
            res_ptr,
            res_out_ptr,
            nw_ptr,
            rows,
            m_mask,
            kk,
            k_mask,
            rstd,
            write_res,
            stride_xm,
            stride_rm,
            stride_rom,
            K,
            PROLOGUE,
            HAS_RESIDUAL,
        )  # (PRO_ROWS, BLOCK_K)
        if PRO_ROWS < BLOCK_M:
            a = tl.where(all_rows[:, None] < PRO_ROWS, tl.broadcast_to(a, (BLOCK_M, BLOCK_K)), 0.0).to(a.dtype)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + kk[None, :], mask=n_mask[:, None] & k_mask[None, :])
        if DOT_F32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PREC)  # (BLOCK_M, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_mask = (all_rows < M)[:, None] & n_mask[None, :]
    tl.store(y_ptr + all_rows[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=y_mask)


def skinny_config(n: int, k: int, on_cpu: bool) -> dict:
    """Tiles for an (N, K) weight: enough programs (N / BLOCK_N) to keep every SM streaming."""
    if on_cpu:
        return dict(BLOCK_N=16, BLOCK_K=32, num_stages=1, num_warps=4)
    # H200, M = 1, the four Llama-3-8B projections: 32 x 256 with 4 stages matched cuBLAS on each
    # (qkv, gate_up within 3%, o_proj 12% faster); 16-column tiles were 60% slower on qkv.
    return dict(BLOCK_N=32, BLOCK_K=256, num_stages=4, num_warps=4)


def _ref_input(x, prologue, residual, norm_weight, eps):
    """The unfused ops' result: (projection input, new residual or None)."""
    if prologue == "norm":
        from splitserve.kernels.rmsnorm import rms_norm_ref

        out = rms_norm_ref(x, norm_weight, eps, residual)
        return out if residual is not None else (out, None)
    if prologue == "silu":
        from splitserve.kernels.activation import silu_and_mul_ref

        return silu_and_mul_ref(x), None
    return x, None


def skinny_linear_ref(x, weight, bias=None, prologue="none", residual=None, norm_weight=None, eps=0.0):
    """The unfused reference: the prologue op, then F.linear."""
    a, new_residual = _ref_input(x, prologue, residual, norm_weight, eps)
    y = torch.nn.functional.linear(a, weight, bias)
    return y if prologue != "norm" or residual is None else (y, new_residual)


def _check(x, weight, prologue, residual, norm_weight) -> int:
    if prologue not in PROLOGUES:
        raise ValueError(f"skinny_linear: prologue {prologue!r} is not one of {tuple(PROLOGUES)}")
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"skinny_linear: x must be (M, K) and weight (N, K), got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if weight.stride(1) != 1:
        raise ValueError(f"skinny_linear: weight rows must be contiguous, got strides {weight.stride()}")
    k = weight.shape[1]
    want = 2 * k if prologue == "silu" else k
    if x.shape[1] != want:
        raise ValueError(
            f"skinny_linear: x must have {want} columns for weight (N, {k}) with {prologue!r}, got {x.shape[1]}"
        )
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"skinny_linear: at most {MAX_ROWS} rows, got {x.shape[0]}; use a GEMM")
    if prologue == "norm" and (norm_weight is None or norm_weight.shape != (k,)):
        raise ValueError(f"skinny_linear: prologue 'norm' needs norm_weight ({k},)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"skinny_linear: residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    return k


def skinny_linear_triton(x, weight, bias=None, prologue="none", residual=None, norm_weight=None, eps=0.0, config=None):
    """The Triton kernel; `config` overrides skinny_config (benchmarks and tests only)."""
    m = x.shape[0]
    n, k = weight.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    on_cpu = interpreting(x)
    cfg = dict(skinny_config(n, k, on_cpu), **(config or {}))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    has_res = prologue == "norm" and residual is not None
    res = residual.contiguous() if has_res else x
    res_out = torch.empty_like(x) if has_res else x
    if m > 0:
        _skinny_linear_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
            x,
            res,
            res_out,
            norm_weight if norm_weight is not None else x,
            weight,
            bias if bias is not None else x,
            y,
            m,
            n,
            eps,
            x.stride(0),
            res.stride(0),
            res_out.stride(0),
            weight.stride(0),
            y.stride(0),
            K=k,
            PROLOGUE=PROLOGUES[prologue],
            HAS_RESIDUAL=has_res,
            HAS_BIAS=bias is not None,
            BLOCK_M=MAX_ROWS,
            PRO_ROWS=1 if m == 1 else MAX_ROWS,
            BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"],
            NUM_STAGES=cfg["num_stages"],
            DOT_F32=on_cpu,
            PREC=dot_precision(x.dtype),
            num_warps=cfg["num_warps"],
        )
    return (y, res_out) if has_res else y


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    prologue: str = "none",
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    impl: str = "auto",
):
    """prologue(x) W^T (+ bias) for x of at most MAX_ROWS rows -> (M, N) in x's dtype.

    prologue "norm" with `residual` returns (y, x + residual) like `rms_norm`; "silu" takes
    x (M, 2K) = [gate | up]. See the module docstring for the exact math."""
    _check(x, weight, prologue, residual, norm_weight)
    if use_triton(impl, x, "skinny_linear"):
        return skinny_linear_triton(x, weight, bias, prologue, residual, norm_weight, eps)
    return skinny_linear_ref(x, weight, bias, prologue, residual, norm_weight, eps)
