"""Fused RMSNorm, optionally with the residual add in front of it.

    new_residual = x + residual                        (rounded to x's dtype, as an eager add is)
    out          = weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)    h = new_residual in fp32

This matches Hugging Face's LlamaRMSNorm: the normalisation runs in fp32, the result is cast
to the input dtype before the weight multiply, and the product is rounded to the input dtype.
The fused kernel reads x (and residual) once and writes out (and new_residual) once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._common import next_pow2, use_triton


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    eps,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (h + r).to(dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, summed, mask=mask)
        h = summed.to(tl.float32)
    var = tl.sum(h * h, axis=0) / HIDDEN
    normed = (h * tl.rsqrt(var + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(dtype), mask=mask)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Plain-torch reference with HF Llama numerics."""
    if residual is not None:
        x = x + residual
    h = x.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (weight.float() * normed.float()).to(x.dtype)
    return out if residual is None else (out, x)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Triton kernel: one program per row of the flattened (N, hidden) input."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)  # (N, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        res2 = residual.reshape(-1, hidden).contiguous()
        res_out = torch.empty_like(out)
    else:
        res2 = res_out = out  # unused
    rows = x2.shape[0]
    if rows > 0:
        block = next_pow2(hidden)
        _rms_norm_kernel[(rows,)](
            x2,
            res2,
            weight.contiguous(),
            out,
            res_out,
            eps,
            x2.stride(0),
            res2.stride(0),
            out.stride(0),
            res_out.stride(0),
            HIDDEN=hidden,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 256)),
        )
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, impl: str = "auto"
):
    """RMSNorm over the last dim of x (..., hidden) with weight (hidden,).

    Returns out, or (out, new_residual) when `residual` (same shape as x) is given, where
    new_residual = x + residual and out = norm(new_residual) * weight. Outputs in x's dtype.
    """
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight must be ({x.shape[-1]},), got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if use_triton(impl, x, "rms_norm"):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
