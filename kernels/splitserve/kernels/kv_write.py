"""Write a step's new keys and values into their paged-cache slots.

    slot = block_id * block_size + offset       (slot < 0: padding token, skipped)
    k_cache[block_id, offset] = key[t]           k_cache: (num_blocks, block_size, Hkv, D)

The caches are strided views into the block-major KV tensor (see engine/worker/kv_cache.py), so the
block stride is not block_size * Hkv * D; every stride is passed to the kernel.

An fp8 (e4m3) cache stores clamp(key / k_scale, -448, 448) and clamp(value / v_scale, ...): the
kernel quantizes as it writes (e4m3 casts do not saturate, hence the clamp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._common import next_pow2, use_triton
from splitserve.kernels.pdl import pdl_launch, pdl_prologue


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    inv_k_scale,
    inv_v_scale,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vct,
    stride_vch,
    stride_vcd,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block_id = slot // PAGE
        offset = slot % PAGE
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)  # (BLOCK_H, BLOCK_D)
        k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask)
        if FP8:
            k = tl.minimum(tl.maximum(k.to(tl.float32) * inv_k_scale, -448.0), 448.0)
            v = tl.minimum(tl.maximum(v.to(tl.float32) * inv_v_scale, -448.0), 448.0)
        kc = k_cache_ptr + block_id * stride_kcb + offset * stride_kct
        vc = v_cache_ptr + block_id * stride_vcb + offset * stride_vct
        tl.store(kc + h[:, None] * stride_kch + d[None, :] * stride_kcd, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc + h[:, None] * stride_vch + d[None, :] * stride_vcd, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check(key, value, k_cache, v_cache, slot_mapping) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"write_kv: key and value must both be (T, Hkv, D), got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"write_kv: caches must both be (num_blocks, block_size, Hkv, D), got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"write_kv: key heads/dim {tuple(key.shape[1:])} do not match the cache's {tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"write_kv: slot_mapping must be ({key.shape[0]},), got {tuple(slot_mapping.shape)}")


def _stored(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    if cache.dtype != torch.float8_e4m3fn:
        return x.to(cache.dtype)
    return (x.float() / scale).clamp(-448.0, 448.0).to(cache.dtype)


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Plain-torch reference: scatter key/value (T, Hkv, D) into the caches in place."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0  # (T,)
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = _stored(key[valid], k_cache, k_scale)
    v_cache[blocks, offsets] = _stored(value[valid], v_cache, v_scale)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Triton kernel: one program per token; padding tokens (slot < 0) write nothing."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_h, block_d = next_pow2(num_heads), next_pow2(head_dim)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        1.0 / k_scale,
        1.0 / v_scale,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        PAGE=k_cache.shape[1],
        FP8=k_cache.dtype == torch.float8_e4m3fn,
        **pdl_launch(key),
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    impl: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write key/value (T, Hkv, D) into k_cache/v_cache (num_blocks, block_size, Hkv, D) at
    slot_mapping (T,) int64; negative slots are padding and are skipped. In place.
    An fp8 cache stores key / k_scale and value / v_scale (the scales are ignored otherwise)."""
    _check(key, value, k_cache, v_cache, slot_mapping)
    if use_triton(impl, key, "write_kv"):
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
