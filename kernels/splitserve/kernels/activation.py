"""SiLU-and-mul, the gated MLP activation: (T, 2F) -> (T, F) = silu(x[:, :F]) * x[:, F:].

Numerics follow the eager torch expression `F.silu(gate) * up`: silu is computed in fp32 and
rounded to the input dtype, then the product is computed in fp32 and rounded again.

`silu_and_mul_quant` gives that output quantized per token for an fp8 projection, in one launch:
(x_q e4m3, scale (T, 1) fp32), the bytes kernels.fp8_quant writes for silu_and_mul's output (the
same `_silu_mul` math, rounded to the input dtype, then that file's `fp8_row_scale` / `fp8_quantize`).
One program per row, since the scale needs the row's max: a row of up to _MAX_ONE_PASS_F features is
held in registers (read once); a wider one is read twice (max, then quantize; the second read hits L2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from splitserve.kernels._common import next_pow2, use_triton
from splitserve.kernels.fp8_quant import fp8_quantize, fp8_row_scale, quantize_per_token_ref
from splitserve.kernels.pdl import pdl_launch, pdl_prologue

_BLOCK_F = 1024
# Widest row silu_and_mul_quant keeps in registers: Llama-3-8B's 14336 features -> 16384, 32 values a thread
# in 16 warps.
_MAX_ONE_PASS_F = 16384


@triton.jit
def _silu_mul(gate, up):
    """silu(gate) * up as eager torch computes it: fp32 math, silu rounded to gate's dtype, the product in
    fp32 (returned in fp32, for the caller to round to gate's dtype)."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return act.to(tl.float32) * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, FEAT: tl.constexpr, BLOCK_F: tl.constexpr, PDL: tl.constexpr
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = cols < FEAT
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + FEAT + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, _silu_mul(gate, up).to(gate.dtype), mask=mask)


@triton.jit
def _silu_mul_row(x_ptr, row, stride_x, f0, FEAT: tl.constexpr, BLOCK_F: tl.constexpr):
    """(silu(gate) * up rounded to x's dtype, in fp32; its mask) of features f0 .. f0 + BLOCK_F of a row."""
    cols = f0 + tl.arange(0, BLOCK_F)
    mask = cols < FEAT
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + FEAT + cols, mask=mask, other=0.0)
    return _silu_mul(gate, up).to(gate.dtype).to(tl.float32), mask


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr, q_ptr, scale_ptr, stride_x, stride_q, min_scale, FEAT: tl.constexpr, BLOCK_F: tl.constexpr, PDL: tl.constexpr
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_F)
    if BLOCK_F >= FEAT:  # the whole row in registers
        y, mask = _silu_mul_row(x_ptr, row, stride_x, 0, FEAT, BLOCK_F)
        scale = fp8_row_scale(tl.abs(y), min_scale)  # masked features are 0: no effect on the max
        tl.store(q_ptr + row * stride_q + offs, fp8_quantize(y, 1.0 / scale, q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK_F], dtype=tl.float32)
        for f0 in range(0, FEAT, BLOCK_F):
            y, mask = _silu_mul_row(x_ptr, row, stride_x, f0, FEAT, BLOCK_F)
            amax = tl.maximum(amax, tl.abs(y))
        scale = fp8_row_scale(amax, min_scale)
        inv = 1.0 / scale
        for f0 in range(0, FEAT, BLOCK_F):
            y, mask = _silu_mul_row(x_ptr, row, stride_x, f0, FEAT, BLOCK_F)
            tl.store(q_ptr + row * stride_q + f0 + offs, fp8_quantize(y, inv, q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference."""
    feat = x.shape[-1] // 2
    return F.silu(x[..., :feat]) * x[..., feat:]


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton kernel: grid (rows, F / 1024)."""
    feat = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * feat)  # (N, 2F)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], feat), dtype=x.dtype, device=x.device)  # (N, F)
    if x2.shape[0] > 0 and feat > 0:
        block_f = min(_BLOCK_F, triton.next_power_of_2(feat))
        grid = (x2.shape[0], triton.cdiv(feat, block_f))
        _silu_and_mul_kernel[grid](
            x2, out, x2.stride(0), out.stride(0), FEAT=feat, BLOCK_F=block_f, **pdl_launch(x2), num_warps=4
        )
    return out.view(*x.shape[:-1], feat)


def silu_and_mul(x: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x (..., 2F) -> (..., F) = silu(x[..., :F]) * x[..., F:], in x's dtype."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"silu_and_mul: last dim must be even (2F), got {x.shape[-1]}")
    if use_triton(impl, x, "silu_and_mul"):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


def silu_and_mul_quant(
    x: torch.Tensor, min_scale: float, impl: str = "auto", max_block_f: int = _MAX_ONE_PASS_F
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul(x (..., 2F)) quantized per token, as kernels.fp8_quant.quantize_per_token(out, min_scale)
    would: (x_q (N, F) e4m3, scale (N, 1) fp32), N = the rows of x. `max_block_f` (a power of two): the
    widest row read once (wider rows are read twice; tests lower it to reach that path)."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"silu_and_mul_quant: last dim must be even (2F), got {x.shape[-1]}")
    feat = x.shape[-1] // 2
    if not use_triton(impl, x, "silu_and_mul_quant"):
        return quantize_per_token_ref(silu_and_mul_ref(x).reshape(-1, feat), min_scale)
    x2 = x.reshape(-1, 2 * feat)  # (N, 2F)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    x_q = torch.empty((x2.shape[0], feat), dtype=torch.float8_e4m3fn, device=x.device)  # (N, F)
    scale = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device)  # (N, 1)
    if x2.shape[0] > 0:
        block_f = min(max_block_f, next_pow2(feat))
        _silu_and_mul_quant_kernel[(x2.shape[0],)](
            x2,
            x_q,
            scale,
            x2.stride(0),
            x_q.stride(0),
            min_scale,
            FEAT=feat,
            BLOCK_F=block_f,
            **pdl_launch(x2),
            num_warps=min(16, max(1, block_f // 512)),
        )
    return x_q, scale
