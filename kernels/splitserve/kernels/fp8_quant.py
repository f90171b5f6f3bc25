"""Dynamic per-token FP8 quantization: one launch per linear input instead of five torch ops.

    x (T, K) -> x_q (T, K) float8_e4m3fn,  scale (T, 1) fp32 = max(amax(|x[t]|) / 448, min_scale)
    x_q[t] = clamp(x[t] / scale[t], -448, 448) cast to e4m3

One program per row: a first pass over the row finds its amax, a second writes the quantized
row (the row is in L2 by then). The torch reference beside it does the same in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._common import next_pow2, use_triton
from splitserve.kernels.pdl import pdl_launch, pdl_prologue

FP8_MAX = 448.0


@triton.jit
def fp8_row_scale(amax, min_scale):
    """A row's scale from its elementwise |x| maxima (any shape, fp32): max(amax) / 448, at least min_scale.
    Every kernel that quantizes per token calls this and `fp8_quantize`, so fused producers
    (kernels.rmsnorm, kernels.activation) write the bytes this file's kernel writes."""
    return tl.maximum(tl.max(amax, axis=0) / 448.0, min_scale)  # 448: largest finite e4m3


@triton.jit
def fp8_quantize(x, inv_scale, fp8_dtype: tl.constexpr):
    """fp32 values times 1 / scale, clamped to +-448 (the cast does not saturate), cast to e4m3."""
    return tl.minimum(tl.maximum(x * inv_scale, -448.0), 448.0).to(fp8_dtype)


@triton.jit
def _quant_kernel(
    x_ptr, q_ptr, scale_ptr, K, stride_xt, stride_qt, min_scale, BLOCK_K: tl.constexpr, PDL: tl.constexpr
):
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + t * stride_xt + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = fp8_row_scale(amax, min_scale)
    inv = 1.0 / scale
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offs < K
        x = tl.load(x_ptr + t * stride_xt + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + t * stride_qt + k0 + offs, fp8_quantize(x, inv, q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + t, scale)


def quantize_per_token_ref(x: torch.Tensor, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference: (x_q (T, K) e4m3, scale (T, 1) fp32)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=min_scale)  # (T, 1)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_per_token_triton(x: torch.Tensor, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, k = x.shape
    x_q = torch.empty((num_tokens, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return x_q, scale
    block_k = min(4096, next_pow2(k))
    _quant_kernel[(num_tokens,)](
        x,
        x_q,
        scale,
        k,
        x.stride(0),
        x_q.stride(0),
        min_scale,
        BLOCK_K=block_k,
        **pdl_launch(x),
        num_warps=4 if block_k >= 1024 else 1,
    )
    return x_q, scale


def quantize_per_token(x: torch.Tensor, min_scale: float, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of x (T, K) (unit stride along K) to e4m3 with its own fp32 scale (T, 1)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_per_token: x must be (T, K) with unit stride along K, got {tuple(x.shape)}")
    if use_triton(impl, x, "quantize_per_token"):
        return quantize_per_token_triton(x, min_scale)
    return quantize_per_token_ref(x, min_scale)


# Per token per group of G features (block-wise fp8 checkpoints' activations, kernels.fp8_block_linear):
#     x (T, K) -> x_q (T, K) e4m3, scale (T, K / G) fp32 = max(amax(|x[t, group]|) / 448, min_scale)
# The scale as fp8_row_scale makes it (what torch on the GPU computes for amax / 448: the product with 1 / 448, one
# ulp off the quotient at times, which moves a value sitting on an e4m3 tie), the values divided rounding to nearest
# (div_rn, as torch's tensor division), so on a GPU the kernel writes the torch reference's bytes.
GROUPS_PER_PROGRAM = 8


@triton.jit
def _group_quant_kernel(
    x_ptr, q_ptr, scale_ptr, num_groups, stride_xt, stride_qt, stride_st, stride_sg, min_scale,
    G: tl.constexpr, NG: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * NG + tl.arange(0, NG)  # (NG,) this program's groups
    in_row = g < num_groups
    k = g[:, None] * G + tl.arange(0, G)[None, :]  # (NG, G)
    x = tl.load(x_ptr + t * stride_xt + k, mask=in_row[:, None], other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) / 448.0, min_scale)  # (NG,) fp8_row_scale's arithmetic
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -448.0), 448.0)
    tl.store(q_ptr + t * stride_qt + k, q.to(q_ptr.dtype.element_ty), mask=in_row[:, None])
    tl.store(scale_ptr + t * stride_st + g * stride_sg, scale, mask=in_row)


def quantize_per_token_group_ref(x: torch.Tensor, group: int, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference: (x_q (T, K) e4m3, scale (T, K / group) fp32)."""
    rows, k = x.shape
    xf = x.float().reshape(rows, k // group, group)
    scale = (xf.abs().amax(dim=2) / FP8_MAX).clamp(min=min_scale)  # (T, K / group)
    return (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(rows, k), scale


def quantize_per_token_group(
    x: torch.Tensor, group: int, min_scale: float, impl: str = "auto", column_major: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x (T, K) (unit stride along K, K a multiple of `group`, a power of two) per token per `group`
    features: one launch on a GPU, bytes equal to the reference's. `column_major` = P > 0: the scales (T, K / group)
    stored token-fastest, each group's column padded to a multiple of P tokens (what cuBLASLt's block scaling reads:
    engine.worker.fp8)."""
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] % group or group & (group - 1):
        raise ValueError(
            f"quantize_per_token_group: x must be (T, K) with unit stride along K and K a multiple of the group, "
            f"a power of two; got {tuple(x.shape)} in groups of {group}"
        )
    if not use_triton(impl, x, "quantize_per_token_group"):
        return quantize_per_token_group_ref(x, group, min_scale)
    rows, k = x.shape
    groups = k // group
    x_q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    if column_major:
        padded = -(-max(rows, 1) // column_major) * column_major
        scale = torch.empty((groups, padded), dtype=torch.float32, device=x.device).t()[:rows]
    else:
        scale = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if rows == 0:
        return x_q, scale
    ng = min(GROUPS_PER_PROGRAM, next_pow2(groups))
    _group_quant_kernel[(rows, triton.cdiv(groups, ng))](
        x, x_q, scale, groups, x.stride(0), x_q.stride(0), scale.stride(0), scale.stride(1), min_scale,
        G=group, NG=ng, **pdl_launch(x), num_warps=4,
    )  # fmt: skip
    return x_q, scale
