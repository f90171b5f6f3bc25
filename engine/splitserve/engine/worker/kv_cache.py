"""The KV cache tensor of a `KvLayout` (the record itself is torch-free: splitserve.common.kv_layout)."""

from __future__ import annotations

import torch

from splitserve.common.kv_layout import DTYPE_ITEMSIZE, KvLayout

_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
assert set(_DTYPES) == set(DTYPE_ITEMSIZE)


def dtype_from_name(name: str) -> torch.dtype:
    """Map a dtype name ('bfloat16', 'float32', ...) to a torch dtype."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported; choose one of {sorted(_DTYPES)}") from None


def torch_dtype(layout: KvLayout) -> torch.dtype:
    """The torch dtype of the layout's KV cache."""
    return dtype_from_name(layout.dtype)


def allocate_kv_cache(layout: KvLayout, num_blocks: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed KV cache tensor of `num_blocks` blocks on `device`: layout.cache_shape(num_blocks)."""
    return torch.zeros(layout.cache_shape(num_blocks), dtype=torch_dtype(layout), device=device)


def as_bytes(kv: torch.Tensor) -> torch.Tensor:
    """An fp8 KV tensor (or slice) viewed as uint8 for copies: CPU index_copy_, gloo and NCCL lack fp8.
    Other dtypes come back as they are."""
    return kv.view(torch.uint8) if kv.dtype == torch.float8_e4m3fn else kv


def layer_kv(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one layer's key and value caches: each (num_blocks, block_size, num_kv_heads, head_dim)."""
    return kv_cache[:, layer, 0], kv_cache[:, layer, 1]
