"""Rotary embedding and the KV-cache write in one launch (a decode step's attention prologue).

    q[t]  <- rope(q[t], positions[t])                       in place, (T, Hq, D)
    k[t]  <- rope(k[t], positions[t])                       in place, (T, Hkv, D)
    k_cache[slot // bs, slot % bs] = k[t] (rotated),  v_cache[...] = v[t]     slot = slot_mapping[t] >= 0

The same arithmetic as `rotary.rotary_embedding` followed by `kv_write.write_kv` (fp32 rotation, one
rounding to the input dtype, then the cache's dtype), but one program per token does both, so the
rotated key goes to the cache from registers instead of a second launch reading it back. At batch 1
the two ops are short launches each per layer, a measurable share of an 8B model's decode step
(docs/performance.md, "Findings that set defaults": fused rotary + KV write).

With `q_norm` / `k_norm` (Qwen3's per-head RMSNorm of q and k, before the rotation) each head is normalized
first, with `rmsnorm`'s numerics (fp32 mean of squares, the normalized row rounded to the input dtype, times the
weight, rounded again): two norm launches and the two copies that reshaping q and k out of the fused projection's
output takes go. Its sum of squares adds the two halves' sums, so it may round apart from the norm kernel's in
the last bit of the mean.

An fp8 (e4m3) cache gets what `kv_write` stores there, bit for bit: the rotated key rounded to k's
dtype, then clamp(float32(k) * float32(1 / k_scale), -448, 448) cast to e4m3 (v likewise with v_scale);
the same operations in the same order as kv_write's kernel, so the cached bytes equal the unfused ops'.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._common import next_pow2, use_triton
from splitserve.kernels.kv_write import _check as _check_write
from splitserve.kernels.kv_write import write_kv_ref
from splitserve.kernels.pdl import pdl_launch, pdl_prologue
from splitserve.kernels.rmsnorm import rms_norm_ref
from splitserve.kernels.rotary import rotary_embedding_ref


@triton.jit
def _rope_heads(x1, x2, cos, sin):
    """(H, D/2) halves -> rotated halves in fp32."""
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    return a * cos[None, :] - b * sin[None, :], b * cos[None, :] + a * sin[None, :]


@triton.jit
def _rms_heads(x1, x2, w_ptr, i, eps, HALF: tl.constexpr):
    """(H, D/2) halves of each head -> the halves of weight * rmsnorm(head), in x1's dtype (rmsnorm's numerics)."""
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    var = (tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF)
    inv = tl.rsqrt(var + eps)[:, None]
    w1 = tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    n1 = (a * inv).to(x1.dtype).to(tl.float32)
    n2 = (b * inv).to(x1.dtype).to(tl.float32)
    return (n1 * w1).to(x1.dtype), (n2 * w2).to(x1.dtype)


@triton.jit
def _fp8_scaled(x, inv_scale):
    """x (k's dtype) -> clamp(float32(x) * inv_scale, -448, 448) in fp32, as kv_write's fp8 path computes it."""
    return tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -448.0), 448.0)


@triton.jit
def _rotary_kv_write_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    cos_sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    inv_k_scale,
    inv_v_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    stride_cs,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PAGE: tl.constexpr,
    FP8: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    # query heads: rotated in place
    hq = tl.arange(0, BLOCK_QH)
    q_mask = (hq[:, None] < NUM_Q_HEADS) & (i[None, :] < HALF)  # (BLOCK_QH, BLOCK_HALF)
    q1_ptr = q_ptr + t * stride_qt + hq[:, None] * stride_qh + i[None, :]
    q1 = tl.load(q1_ptr, mask=q_mask, other=0.0)
    q2 = tl.load(q1_ptr + HALF, mask=q_mask, other=0.0)
    if NORM:
        q1, q2 = _rms_heads(q1, q2, q_norm_ptr, i, eps, HALF)
    r1, r2 = _rope_heads(q1, q2, cos, sin)
    tl.store(q1_ptr, r1.to(q1.dtype), mask=q_mask)
    tl.store(q1_ptr + HALF, r2.to(q1.dtype), mask=q_mask)
    # key heads: rotated in place (the caller's k stays what rotary_embedding would leave) and cached
    hk = tl.arange(0, BLOCK_KH)
    k_mask = (hk[:, None] < NUM_KV_HEADS) & (i[None, :] < HALF)  # (BLOCK_KH, BLOCK_HALF)
    k1_ptr = k_ptr + t * stride_kt + hk[:, None] * stride_kh + i[None, :]
    k1 = tl.load(k1_ptr, mask=k_mask, other=0.0)
    k2 = tl.load(k1_ptr + HALF, mask=k_mask, other=0.0)
    if NORM:
        k1, k2 = _rms_heads(k1, k2, k_norm_ptr, i, eps, HALF)
    s1, s2 = _rope_heads(k1, k2, cos, sin)
    k1 = s1.to(k1.dtype)
    k2 = s2.to(k1.dtype)
    tl.store(k1_ptr, k1, mask=k_mask)
    tl.store(k1_ptr + HALF, k2, mask=k_mask)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block_id = slot // PAGE
        offset = slot % PAGE
        v1_ptr = v_ptr + t * stride_vt + hk[:, None] * stride_vh + i[None, :]
        v1 = tl.load(v1_ptr, mask=k_mask, other=0.0)
        v2 = tl.load(v1_ptr + HALF, mask=k_mask, other=0.0)
        kc = k_cache_ptr + block_id * stride_kcb + offset * stride_kct + hk[:, None] * stride_kch + i[None, :]
        vc = v_cache_ptr + block_id * stride_vcb + offset * stride_vct + hk[:, None] * stride_vch + i[None, :]
        kc_dtype = k_cache_ptr.dtype.element_ty
        vc_dtype = v_cache_ptr.dtype.element_ty
        if FP8:  # kv_write's quantization, operation for operation (e4m3 casts do not saturate)
            tl.store(kc, _fp8_scaled(k1, inv_k_scale).to(kc_dtype), mask=k_mask)
            tl.store(kc + HALF, _fp8_scaled(k2, inv_k_scale).to(kc_dtype), mask=k_mask)
            tl.store(vc, _fp8_scaled(v1, inv_v_scale).to(vc_dtype), mask=k_mask)
            tl.store(vc + HALF, _fp8_scaled(v2, inv_v_scale).to(vc_dtype), mask=k_mask)
        else:
            tl.store(kc, k1.to(kc_dtype), mask=k_mask)
            tl.store(kc + HALF, k2.to(kc_dtype), mask=k_mask)
            tl.store(vc, v1.to(vc_dtype), mask=k_mask)
            tl.store(vc + HALF, v2.to(vc_dtype), mask=k_mask)


def rotary_kv_write_ref(
    positions,
    q,
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    cos_sin_cache,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    q_norm=None,
    k_norm=None,
    eps: float = 0.0,
) -> None:
    """The unfused references, in order: normalize q and k (with norms), rotate them in place, scatter k and v."""
    if q_norm is not None:
        q.copy_(rms_norm_ref(q, q_norm, eps))
        k.copy_(rms_norm_ref(k, k_norm, eps))
    rotary_embedding_ref(positions, q, k, cos_sin_cache)
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _launch(
    positions, q, k, v, k_cache, v_cache, slot_mapping, cos_sin_cache, k_scale, v_scale, q_norm, k_norm, eps
) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kv_write_kernel[(num_tokens,)](
        positions,
        q,
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        cos_sin_cache,
        q if q_norm is None else q_norm,
        q if k_norm is None else k_norm,
        eps,
        1.0 / k_scale,  # what kv_write passes: its kernel multiplies by the fp32 rounding of this
        1.0 / v_scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=k.shape[1],
        HALF=half,
        BLOCK_QH=next_pow2(num_q_heads),
        BLOCK_KH=next_pow2(k.shape[1]),
        BLOCK_HALF=next_pow2(half),
        PAGE=k_cache.shape[1],
        FP8=k_cache.dtype == torch.float8_e4m3fn,
        NORM=q_norm is not None,
        **pdl_launch(q),
        num_warps=4,
    )


def rotary_kv_write(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    impl: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    """With q_norm / k_norm (D,) weights (both or neither), first RMS-normalize each head of q and k in place (eps),
    then: rotate q (T, Hq, D) and k (T, Hkv, D) in place (neox RoPE at positions (T,)), then write k and
    v (T, Hkv, D) into k_cache/v_cache (num_blocks, block_size, Hkv, D) at slot_mapping (T,) (< 0: skipped).
    An fp8 (e4m3) cache stores k / k_scale and v / v_scale, clamped to +-448 (the scales are ignored
    otherwise). Equal to (`rms_norm` per head,) `rotary_embedding` then `write_kv` with the same impl, bit for bit
    (but the norm's mean of squares: see the module's docstring); the head dim must be contiguous in every tensor."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("rotary_kv_write: q_norm and k_norm come together")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and (w.shape != (q.shape[-1],) or w.stride(0) != 1):
            raise ValueError(f"rotary_kv_write: {name} must be a contiguous ({q.shape[-1]},), got {tuple(w.shape)}")
    _check_write(k, v, k_cache, v_cache, slot_mapping)
    for name, x in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"rotary_kv_write: {name}'s head dim must be contiguous, got strides {x.stride()}")
    if q.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"rotary_kv_write: q must be (T, Hq, D) like k {tuple(k.shape)}, got {tuple(q.shape)}")
    if positions.shape != (q.shape[0],):
        raise ValueError(f"rotary_kv_write: positions must be ({q.shape[0]},), got {tuple(positions.shape)}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != q.shape[2] or cos_sin_cache.stride(1) != 1:
        raise ValueError(
            f"rotary_kv_write: cos_sin_cache must be a row-contiguous (max_pos, {q.shape[2]}), "
            f"got {tuple(cos_sin_cache.shape)}"
        )
    if use_triton(impl, q, "rotary_kv_write"):
        norms = (q_norm, k_norm, eps)
        _launch(positions, q, k, v, k_cache, v_cache, slot_mapping, cos_sin_cache, k_scale, v_scale, *norms)
    else:
        rotary_kv_write_ref(
            positions, q, k, v, k_cache, v_cache, slot_mapping, cos_sin_cache, k_scale, v_scale, q_norm, k_norm, eps
        )
