"""How paged decode attention launches: split-K per sequence, and the kernel and tiles for a call.

`choose_num_splits` sets the split-K factor from the batch, the KV heads and an upper bound on the context (no
device sync, so a CUDA graph captures the choice); `decode_config` / `resolve_config` pick the kernel variant
and tiles (paged_decode_attention.py and paged_decode_attention_fp8.py say what each variant is);
`extras_config` those of a call with attention sinks or a sliding window, which run in the upcast kernel only.
"""

from __future__ import annotations

import torch

# Split-K heuristic constants (see choose_num_splits and docs/performance.md, "Findings that set defaults").
_TARGET_PROGRAMS_PER_SM = 4
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, sm_count: int) -> int:
    """Splits per sequence so that batch * num_kv_heads * splits programs fill the GPU.

    splits = the power of two at or below target / programs, target = `_TARGET_PROGRAMS_PER_SM`
    per SM, with each split covering at least `_MIN_TOKENS_PER_SPLIT` tokens of `max_context` (an
    upper bound: block_tables width * block_size, so no device sync). It picked the best measured count at every
    swept shape (docs/performance.md, "Findings that set defaults": decode split-K).
    """
    programs = batch * num_kv_heads
    wanted = max(1, (_TARGET_PROGRAMS_PER_SM * sm_count) // programs)
    by_length = max(1, max_context // _MIN_TOKENS_PER_SPLIT)
    limit = min(wanted, by_length, _MAX_SPLITS)
    return 1 << (limit.bit_length() - 1)


FP8_UPCAST_TILE = dict(BLOCK_N=128, num_warps=4, num_stages=2)  # the upcast kernel's best tile for fp8 caches


def decode_config(head_dim: int, dtype: torch.dtype, on_cpu: bool, kv_dtype: torch.dtype | None = None) -> dict:
    """Tile sizes and launch parameters for the decode kernel (`kv_dtype`: the cache's, default q's)."""
    if on_cpu:
        return dict(BLOCK_N=32, num_warps=4, num_stages=1)
    if dtype == torch.float32 or head_dim > 128:
        return dict(BLOCK_N=32, num_warps=4, num_stages=2)
    if kv_dtype == torch.float8_e4m3fn:
        if head_dim >= 16 and head_dim & (head_dim - 1) == 0:
            # the "rows" variant (words converted in registers, 16-bit q): faster than the upcast kernel
            # (docs/performance.md, "Findings that set defaults": Triton fallback for fp8 caches)
            return dict(VARIANT="rows", HEADS_FIRST=True, BLOCK_N=64, num_warps=4, num_stages=2)
        return dict(FP8_UPCAST_TILE)
    return dict(BLOCK_N=64, num_warps=4, num_stages=2)  # best of the sweep (docs/performance.md, decode tile)


def resolve_config(head_dim: int, dtype, on_cpu: bool, k_cache, v_cache, config: dict | None = None) -> dict:
    """decode_config for these caches with `config` over it. An override that names no VARIANT, and caches the
    fp8 variants cannot read (head dim not contiguous), take the upcast kernel on its fp8 tile instead of the
    default variant."""
    base = decode_config(head_dim, dtype, on_cpu, k_cache.dtype)
    if "VARIANT" in base and (
        (config and "VARIANT" not in config) or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1
    ):
        base = dict(FP8_UPCAST_TILE)
    return dict(base, **(config or {}))


def extras_config(head_dim, dtype, on_cpu, k_cache, v_cache, config) -> dict:
    """The upcast kernel's tiles for a call with sinks or a window (an fp8 cache: its upcast tile); `config` over
    them, which may name no other VARIANT."""
    if config is not None and config.get("VARIANT", "upcast") != "upcast":
        raise ValueError(
            f"paged_decode_attention: sinks and sliding windows run in VARIANT 'upcast' only, got {config['VARIANT']!r}"
        )
    base = decode_config(head_dim, dtype, on_cpu)  # q's dtype: the 16-bit tile, no fp8 variant
    if k_cache.dtype == torch.float8_e4m3fn and not on_cpu:
        base = dict(FP8_UPCAST_TILE)
    return dict(base, **(config or {}), VARIANT="upcast")
