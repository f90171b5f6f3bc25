"""Rotary position embedding, neox style (rotate halves), applied in place to q and k.

    cos_sin_cache: (max_pos, D) = cat(cos (max_pos, D/2), sin (max_pos, D/2))
    x = cat(x1, x2) over the head dim (halves of D/2):
        x1' = x1 * cos - x2 * sin
        x2' = x2 * cos + x1 * sin

which is HF's `x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`. The kernel computes in fp32
and rounds once to x's dtype. `build_cos_sin_cache` makes the cache (rope scaling applied to the
inverse frequencies: default, linear, llama3 and yarn; yarn also scales cos/sin by its attention factor).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from splitserve.kernels._common import next_pow2, use_triton
from splitserve.kernels.pdl import pdl_launch, pdl_prologue

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@triton.jit
def _rotate_heads(
    x_ptr,
    t,
    stride_t,
    stride_h,
    stride_d,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < NUM_HEADS) & (i[None, :] < HALF)  # (BLOCK_H, BLOCK_HALF)
    ptr1 = x_ptr + t * stride_t + h[:, None] * stride_h + i[None, :] * stride_d
    ptr2 = ptr1 + HALF * stride_d
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr2, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(ptr1, (a * cos[None, :] - b * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(ptr2, (b * cos[None, :] + a * sin[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_cache,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, t, stride_qt, stride_qh, stride_qd, cos, sin, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(k_ptr, t, stride_kt, stride_kh, stride_kd, cos, sin, NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF)


def rope_inv_freq(head_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies (D/2,) fp32, with the rope scaling applied (also engine.worker.layers' cache)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    pos_freqs = base**exponents  # (D/2,)
    inv_freq = 1.0 / pos_freqs
    rope_type = (
        "default" if rope_scaling is None else rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    )
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"build_cos_sin_cache: rope_type {rope_type!r} is not supported; choose one of {ROPE_TYPES}")
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(pos_freqs, head_dim, base, rope_scaling)
    return inv_freq


def rope_attention_factor(rope_scaling: dict | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (given, or 0.1 ln(factor) + 1, or the ratio of
    two such terms with `mscale` / `mscale_all_dim`); 1.0 for every other rope type."""
    if rope_scaling is None or rope_scaling.get("rope_type") != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = rope_scaling["factor"]
    m, m_all = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def _yarn_inv_freq(pos_freqs: torch.Tensor, head_dim: int, base: float, cfg: dict) -> torch.Tensor:
    """YaRN: dimensions that turn fewer than `beta_slow` times over the original context are interpolated
    (divided by `factor`), those turning more than `beta_fast` times kept, a linear ramp between (float32, as
    transformers computes it; `truncate` rounds the ramp's ends outwards)."""
    factor = cfg["factor"]
    original_len = cfg["original_max_position_embeddings"]
    beta_fast, beta_slow = cfg.get("beta_fast") or 32, cfg.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return (head_dim * math.log(original_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if cfg.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp  # (D/2,) the share of each dimension's original frequency
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


def _llama3_inv_freq(inv_freq: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept, a smooth
    blend between the two bands (wavelengths in tokens, bands set by the original context)."""
    factor = cfg["factor"]
    low, high = cfg["low_freq_factor"], cfg["high_freq_factor"]
    original_len = cfg["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    long_band = wavelen > original_len / low  # slowed down fully
    short_band = wavelen < original_len / high  # untouched
    scaled = torch.where(long_band, inv_freq / factor, inv_freq)
    blend = (original_len / wavelen - low) / (high - low)
    smoothed = (1 - blend) * scaled / factor + blend * scaled
    return torch.where(~long_band & ~short_band, smoothed, scaled)


def build_cos_sin_cache(
    head_dim: int,
    max_pos: int,
    base: float,
    rope_scaling: dict | None,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """cos/sin table (max_pos, head_dim) = cat(cos, sin) over positions 0..max_pos-1.

    rope_scaling: None, or a dict with "rope_type" (or legacy "type") in ROPE_TYPES plus its
    parameters: linear {factor}; llama3 {factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings}. Angles are computed in fp32 (as HF does), then cast.
    """
    if head_dim % 2 != 0:
        raise ValueError(f"build_cos_sin_cache: head_dim must be even, got {head_dim}")
    inv_freq = rope_inv_freq(head_dim, base, rope_scaling)  # (D/2,)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.int64).float(), inv_freq)  # (max_pos, D/2)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    factor = rope_attention_factor(rope_scaling)
    return (cos_sin if factor == 1.0 else cos_sin * factor).to(device=device, dtype=dtype)


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Plain-torch reference (fp32 math, one rounding), in place."""
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache[positions.long()].float()  # (T, D)
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]  # (T, 1, D/2)
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half:].float()  # (T, H, D/2)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x.copy_(rotated.to(x.dtype))


def rotary_embedding_triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Triton kernel: one program per token rotates all its q and k heads."""
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        *q.stride(),
        *k.stride(),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=k.shape[1],
        HALF=half,
        BLOCK_QH=next_pow2(num_q_heads),
        BLOCK_KH=next_pow2(k.shape[1]),
        BLOCK_HALF=next_pow2(half),
        **pdl_launch(q),
        num_warps=4,
    )


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, impl: str = "auto"
) -> None:
    """Rotate q (T, Hq, D) and k (T, Hkv, D) in place by their token's position (T,) (neox style)."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"rotary_embedding: q must be (T, Hq, D) and k (T, Hkv, D), got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if positions.shape != (q.shape[0],):
        raise ValueError(f"rotary_embedding: positions must be ({q.shape[0]},), got {tuple(positions.shape)}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != q.shape[2] or cos_sin_cache.stride(1) != 1:
        raise ValueError(
            f"rotary_embedding: cos_sin_cache must be a row-contiguous (max_pos, {q.shape[2]}), "
            f"got {tuple(cos_sin_cache.shape)}"
        )
    if use_triton(impl, q, "rotary_embedding"):
        rotary_embedding_triton(positions, q, k, cos_sin_cache)
    else:
        rotary_embedding_ref(positions, q, k, cos_sin_cache)
