"""Fused RMSNorm, optionally with the residual add in front of it.

    new_residual = x + residual                        (rounded to x's dtype, as an eager add is)
    out          = weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)    h = new_residual in fp32

This matches Hugging Face's LlamaRMSNorm: the normalisation runs in fp32, the result is cast
to the input dtype before the weight multiply, and the product is rounded to the input dtype.
The fused kernel reads x (and residual) once and writes out (and new_residual) once.

`rms_norm_quant` is the same kernel for an fp8 projection's input: instead of out it writes out
quantized per token, (x_q e4m3, scale (N, 1) fp32), the bytes kernels.fp8_quant writes for out
(out is rounded to x's dtype first; the scale and cast are that file's `fp8_row_scale` / `fp8_quantize`),
so norm + quantizer are one launch and out never goes to memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._common import next_pow2, use_triton
from splitserve.kernels.fp8_quant import fp8_quantize, fp8_row_scale, quantize_per_token_ref
from splitserve.kernels.pdl import pdl_launch, pdl_prologue


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    scale_ptr,
    eps,
    min_scale,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
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
    out = (normed * w).to(dtype)
    if QUANT:  # out_ptr is e4m3: out quantized per token (masked columns are 0: no effect on the max)
        y = out.to(tl.float32)
        scale = fp8_row_scale(tl.abs(y), min_scale)
        tl.store(out_ptr + row * stride_out + cols, fp8_quantize(y, 1.0 / scale, out_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Plain-torch reference with HF Llama numerics."""
    if residual is not None:
        x = x + residual
    h = x.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (weight.float() * normed.float()).to(x.dtype)
    return out if residual is None else (out, x)


def _launch(x, weight, eps, residual, out, scale=None, min_scale=0.0):
    """One program per row of the flattened (N, hidden) x into `out` (x's dtype, or e4m3 with `scale`
    (N, 1) fp32 when quantizing); returns (x2, new_residual (N, hidden) or None)."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)  # (N, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if residual is not None:
        res2 = residual.reshape(-1, hidden).contiguous()
        res_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)  # (N, hidden)
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
            out if scale is None else scale,
            eps,
            min_scale,
            x2.stride(0),
            res2.stride(0),
            out.stride(0),
            res_out.stride(0),
            HIDDEN=hidden,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            QUANT=scale is not None,
            **pdl_launch(x),
            num_warps=min(16, max(1, block // 256)),
        )
    return None if residual is None else res_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Triton kernel: one program per row of the flattened (N, hidden) input."""
    out = torch.empty((x.numel() // x.shape[-1], x.shape[-1]), dtype=x.dtype, device=x.device)  # (N, hidden)
    res_out = _launch(x, weight, eps, residual, out)
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


def rms_norm_quant(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    min_scale: float,
    residual: torch.Tensor | None = None,
    impl: str = "auto",
):
    """rms_norm's out quantized per token, as kernels.fp8_quant.quantize_per_token(out, min_scale) would.

    Returns (x_q (N, hidden) e4m3, scale (N, 1) fp32, new_residual (x's shape) or None without `residual`),
    N = the rows of x (..., hidden). On Triton out itself is never stored; the reference runs the two ops.
    """
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm_quant: weight must be ({x.shape[-1]},), got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm_quant: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    hidden = x.shape[-1]
    if not use_triton(impl, x, "rms_norm_quant"):
        normed = rms_norm_ref(x, weight, eps, residual)
        out, res_out = (normed, None) if residual is None else normed
        return (*quantize_per_token_ref(out.reshape(-1, hidden), min_scale), res_out)
    rows = x.numel() // hidden
    x_q = torch.empty((rows, hidden), dtype=torch.float8_e4m3fn, device=x.device)  # (N, hidden)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)  # (N, 1)
    res_out = _launch(x, weight, eps, residual, x_q, scale, min_scale)
    return x_q, scale, None if res_out is None else res_out.view(x.shape)
