"""Fused GPU paths of the decoder's ops, each with the unfused ops as its fallback.

    norm_linear     RMSNorm(x [+ residual]) then a projection     the norm quantizes for an fp8 projection
    silu_linear     SiLU-mul then a projection                    the SiLU-mul quantizes for an fp8 projection
    rope_write_attend  rotary + KV write, then attention             two launches instead of three (seven
                    with Qwen3's q/k norms, whose two norms and two reshape copies it takes in);
                    a step of fresh prompts reads its own k/v (kernels.fresh_prefill_attention);
                    into a 16-bit cache of k's dtype or an fp8 one (k_scale / v_scale); gpt-oss's
                    sinks and sliding window passed on to the paged kernels

Why: at batch 1 an 8B decode step is ~350 small launches beyond its GEMMs; each fusion here removes
launches or a round trip of the activations (docs/performance.md, "Findings that set defaults"). Few-row
projections with the norm or SiLU-mul recomputed inside them measured slower in the graph than cuBLAS after
the separate launch, so projections run as plain GEMMs (or the one-row GEMV on tuned shapes: `gemv_tiles`).

An fp8 projection that quantizes its input per token for `_scaled_mm` (`Fp8Linear.takes_fused_quant`)
gets it from the launch before it: the RMSNorm or SiLU-mul kernel writes e4m3 values and row scales
(kernels.rmsnorm.rms_norm_quant, kernels.activation.silu_and_mul_quant, bit-equal to the op then
kernels.fp8_quant) and the projection runs `Fp8Linear.forward_quantized`: one launch and one round
trip of the activations fewer per projection (docs/performance.md, "Findings that set defaults").
"""

from __future__ import annotations

import torch

from splitserve.engine.worker.attention import AttentionMetadata, attention_forward, paged_attention_cuda
from splitserve.engine.worker.fp8 import MIN_SCALE, Fp8Linear, cuda_device_name
from splitserve.engine.worker.layers import rotary_embedding
from splitserve.kernels.tuned_configs import tuned_configs

_GEMV_DTYPES = (torch.float16, torch.bfloat16)
# (N, K) of a 16-bit projection -> tiles of kernels.fp8_skinny_linear with that 16-bit weight (no scale), run
# for one-row inputs (the batch-1 decode graph) instead of cuBLAS. None: the device's tuned table
# (kernels/splitserve/kernels/configs, dtype w16a16; cuBLAS for shapes and devices without one); a dict
# replaces it ({}: cuBLAS everywhere).
GEMV_TILES: dict[tuple[int, int], dict] | None = None
_tuned: dict[int, dict[tuple[int, int], dict]] = {}  # device index -> its table


def _device_name(device: torch.device) -> str:
    return cuda_device_name(device)


def gemv_tiles(x: torch.Tensor, weight: torch.Tensor) -> dict | None:
    """The GEMV's tiles when `weight` (N, K) times the one-row x runs as kernels.fp8_skinny_linear; else None."""
    if (
        not x.is_cuda
        or x.dim() != 2
        or x.shape[0] != 1
        or x.dtype not in _GEMV_DTYPES
        or weight.dtype != x.dtype
        or weight.stride(1) != 1
    ):
        return None
    table = GEMV_TILES
    if table is None:
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        if index not in _tuned:
            _tuned[index] = tuned_configs("fp8_skinny_linear", _device_name(x.device), "w16a16").get("gemv", {})
        table = _tuned[index]
    return table.get((weight.shape[0], weight.shape[1]))


def fused_quant_applies(x: torch.Tensor, linear) -> bool:
    """Whether `linear` on x (..., K) takes its input quantized by the op before it (Fp8Linear.takes_fused_quant)."""
    return isinstance(linear, Fp8Linear) and linear.takes_fused_quant(x.numel() // x.shape[-1])


def norm_linear(norm, linear, x: torch.Tensor, residual: torch.Tensor | None):
    """(linear(norm(x + residual)), x + residual); without a residual the stream is x itself."""
    if fused_quant_applies(x, linear):
        from splitserve.kernels.rmsnorm import rms_norm_quant

        x_q, x_scale, new_residual = rms_norm_quant(x, norm.weight, norm.eps, MIN_SCALE, residual)
        y = linear.forward_quantized(x_q, x_scale).view(*x.shape[:-1], -1)
        return y, x if residual is None else new_residual
    if residual is None:
        return linear(norm(x)), x
    h, residual = norm(x, residual)
    return linear(h), residual


def silu_linear(linear, gate_up: torch.Tensor) -> torch.Tensor:
    """linear(silu(gate) * up) of gate_up (T, 2F) = [gate | up]."""
    from splitserve.engine.worker.layers import silu_and_mul

    if fused_quant_applies(gate_up, linear):  # many rows, W8A8: the SiLU-mul launch quantizes
        from splitserve.kernels.activation import silu_and_mul_quant

        return linear.forward_quantized(*silu_and_mul_quant(gate_up, MIN_SCALE)).view(*gate_up.shape[:-1], -1)
    return linear(silu_and_mul(gate_up))


def fused_write_applies(q: torch.Tensor, k: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """rope_write_attend's one-launch rotary + KV write runs on CUDA into a cache of k's dtype or an fp8
    (e4m3) one (kernels.rotary_kv_write quantizes as kv_write does); elsewhere the unfused ops run."""
    return q.is_cuda and k_cache.dtype in (k.dtype, torch.float8_e4m3fn)


def rope_write_attend(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    qk_norm=None,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """(Normalize q/k per head: `qk_norm`, Qwen3's (q_norm, k_norm) RMSNorm modules,) rotate q/k, write k/v into
    the cache, attend: q (T, Hq, D) -> (T, Hq, D). When `fused_write_applies` the norms, the rotation and the
    write are one kernel (`kernels.rotary_kv_write`), then `rope_write_attend_fused`; elsewhere the unfused ops.
    An fp8 cache stores k / k_scale, v / v_scale; sinks / sliding_window: gpt-oss's (engine.worker.attention)."""
    extras = dict(sinks=sinks, sliding_window=sliding_window)
    if fused_write_applies(q, k, k_cache):
        return rope_write_attend_fused(
            positions, q, k, v, cos_sin_cache, k_cache, v_cache, meta, scale, k_scale, v_scale, qk_norm, **extras
        )
    if qk_norm is not None:
        q, k = qk_norm[0](q), qk_norm[1](k)
    rotary_embedding(positions, q, k, cos_sin_cache)
    return attention_forward(q, k, v, k_cache, v_cache, meta, scale, k_scale, v_scale, **extras)


def rope_write_attend_fused(
    positions,
    q,
    k,
    v,
    cos_sin_cache,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    scale,
    k_scale=1.0,
    v_scale=1.0,
    qk_norm=None,
    sinks=None,
    sliding_window=None,
) -> torch.Tensor:
    """The fused path of rope_write_attend (its kernels' torch references on CPU tensors). The scales fold in
    as attention_forward's CUDA path folds them (scale * k_scale, the output times v_scale), so its result
    equals that path's bit for bit; a fresh prompt attends over its own k/v only with a 16-bit cache (an fp8
    cache's prompts read the stored, quantized keys, as attention_forward's do). q and k are normalized (with
    `qk_norm`) and rotated in place."""
    from splitserve.kernels.rotary_kv_write import rotary_kv_write

    norms = {}
    if qk_norm is not None:
        norms = dict(q_norm=qk_norm[0].weight, k_norm=qk_norm[1].weight, eps=qk_norm[0].eps)
    rotary_kv_write(
        positions,
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta.slot_mapping,
        cos_sin_cache,
        k_scale=k_scale,
        v_scale=v_scale,
        **norms,
    )
    own_kv = (k, v) if k_cache.dtype == k.dtype else ()
    extras = dict(sinks=sinks, sliding_window=sliding_window)
    out = paged_attention_cuda(q, k_cache, v_cache, meta, scale * k_scale, *own_kv, **extras)
    return out if v_scale == 1.0 else out.mul_(v_scale)
