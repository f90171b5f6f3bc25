"""SiLU-and-mul, the gated MLP activation: (T, 2F) -> (T, F) = silu(x[:, :F]) * x[:, F:].

Numerics follow the eager torch expression `F.silu(gate) * up`: silu is computed in fp32 and
rounded to the input dtype, then the product is computed in fp32 and rounded again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from splitserve.kernels._common import use_triton

_BLOCK_F = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, FEAT: tl.constexpr, BLOCK_F: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = cols < FEAT
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + FEAT + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(gate.dtype), mask=mask)


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
        _silu_and_mul_kernel[grid](x2, out, x2.stride(0), out.stride(0), FEAT=feat, BLOCK_F=block_f, num_warps=4)
    return out.view(*x.shape[:-1], feat)


def silu_and_mul(x: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x (..., 2F) -> (..., F) = silu(x[..., :F]) * x[..., F:], in x's dtype."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"silu_and_mul: last dim must be even (2F), got {x.shape[-1]}")
    if use_triton(impl, x, "silu_and_mul"):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
