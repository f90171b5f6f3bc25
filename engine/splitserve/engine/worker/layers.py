"""Small tensor ops the decoder uses, one function each: Triton kernels on CUDA, the C++ ops of
`kernels.cpu_ops` for float32 on CPU, plain torch otherwise.
Precision follows transformers: reductions and rotary angles are computed in float32 for
16/32-bit models and cast back; a float64 model computes in float64 throughout, so the
float64 exactness tests compare true float64 math (see tests/model_factory.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half/bfloat16/float32 inputs, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


@functools.cache
def _cpu_ops_module():
    from splitserve.kernels import cpu_ops  # lazily, once: the kernels package imports Triton

    return cpu_ops


def cpu_ops_for(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)):
    """kernels.cpu_ops for a CPU tensor of `dtypes` when its C++ ops are built, else None (torch path).
    The elementwise ops take float32 only: float64 (the exactness tests) keeps the torch path."""
    return _cpu_ops_module().for_tensor(x, dtypes)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim: weight * x / sqrt(mean(x^2) + eps).

    With `residual`, first adds it (x + residual, in x's dtype) and returns
    (normed, new_residual) where new_residual = x + residual; otherwise returns normed.
    """
    if x.is_cuda:
        from splitserve import kernels

        return kernels.rms_norm(x, weight, eps, residual)
    ops = cpu_ops_for(x)
    if ops is not None and weight.dtype == x.dtype:
        return ops.rms_norm_cpu(x, weight, eps, residual)
    if residual is not None:
        x = x + residual  # (..., H)
    if x.dtype in (torch.float32, torch.float64):  # computes in x's dtype already: one fused op
        out = F.rms_norm(x, (x.shape[-1],), weight, eps)  # (..., H)
        return out if residual is None else (out, x)
    xc = x.to(compute_dtype(x.dtype))
    variance = xc.pow(2).mean(-1, keepdim=True)  # (..., 1)
    out = weight * (xc * torch.rsqrt(variance + eps)).to(x.dtype)  # (..., H)
    return out if residual is None else (out, x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(T, 2F) = [gate | up] -> silu(gate) * up, (T, F)."""
    if x.is_cuda:
        from splitserve import kernels

        return kernels.silu_and_mul(x)
    ops = cpu_ops_for(x)
    if ops is not None and x.dim() == 2:
        return ops.silu_and_mul_cpu(x)
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Apply neox-style RoPE in place: q (T, Hq, D), k (T, Hkv, D), positions (T,) int64.

    cos_sin_cache (max_pos, D) is cat(cos (max_pos, D/2), sin (max_pos, D/2)); the first
    and second halves of each head rotate together: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin].
    """
    if q.is_cuda:
        from splitserve import kernels

        kernels.rotary_embedding(positions, q, k, cos_sin_cache)
        return
    ops = cpu_ops_for(q)
    if ops is not None and cos_sin_cache.dtype == q.dtype:
        ops.rotary_cpu(positions, q, k, cos_sin_cache)
        return
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache[positions]  # (T, D)
    cos = cos_sin[:, :half].unsqueeze(1)  # (T, 1, D/2)
    sin = cos_sin[:, half:].unsqueeze(1)
    for x in (q, k):
        x1, x2 = x[..., :half], x[..., half:]  # (T, H, D/2) each
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (T, H, D)
        x.copy_(rotated)


def build_cos_sin_cache(
    head_dim: int,
    max_pos: int,
    base: float,
    rope_scaling: dict | None,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """(max_pos, head_dim) = cat(cos, sin) of position * inv_freq, stored in `dtype`.

    Frequencies are float32, as transformers computes them (kernels.rotary.rope_inv_freq: rope_scaling
    None / {"rope_type": "default"}, "linear", "llama3" or "yarn", whose attention factor scales cos/sin);
    angles and cos/sin are in compute_dtype(dtype).
    """
    from splitserve.kernels.rotary import rope_attention_factor, rope_inv_freq  # lazily: the package imports Triton

    inv_freq = rope_inv_freq(head_dim, base, rope_scaling)  # (D/2,) float32
    work = compute_dtype(dtype)
    inv_freq = inv_freq.to(device=device, dtype=work)
    angles = torch.arange(max_pos, dtype=work, device=device)[:, None] * inv_freq[None, :]  # (P, D/2)
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)  # (P, D)
    factor = rope_attention_factor(rope_scaling)  # YaRN's; 1.0 for the other rope types
    return (cos_sin if factor == 1.0 else cos_sin * factor).to(dtype)
