"""The KV cache layout: one tensor per worker, block-major.

    kv_cache: (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
                   │          │       │       │
                   │          │       │       └─ token offset inside the block
                   │          │       └─ 0 = keys, 1 = values
                   │          └─ decoder layer
                   └─ block_id (what block tables and KV handles name)

A slot is `block_id * block_size + offset`. Block-major means one block holds every
layer's keys and values for its `block_size` tokens in one contiguous run of
`block_nbytes` bytes, so moving a request's blocks to another process is a copy of
whole contiguous blocks (one gather, or one block-to-block copy), never one message
per layer. Layer `l`'s keys are the strided view `kv_cache[:, l, 0]` with shape
(num_blocks, block_size, num_kv_heads, head_dim): attention kernels take strides.

`KvLayout` describes this tensor; two instances may exchange blocks only when their
layouts are equal (the gateway checks at registration).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

LAYOUT_NAME = "block_major_v1"

_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def dtype_from_name(name: str) -> torch.dtype:
    """Map a dtype name ('bfloat16', 'float32', ...) to a torch dtype."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported; choose one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not supported; choose one of {sorted(_DTYPES)}")


@dataclass(frozen=True)
class KvLayout:
    """Shape and identity of a worker's KV cache (see the module docstring)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # a key of _DTYPES
    model_id: str
    layout: str = LAYOUT_NAME

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def block_numel(self) -> int:
        """Elements in one block (all layers, K and V)."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def block_nbytes(self) -> int:
        return self.block_numel * self.torch_dtype.itemsize

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def allocate(self, num_blocks: int, device: torch.device | str) -> torch.Tensor:
        """A zeroed KV cache tensor of `num_blocks` blocks on `device`."""
        return torch.zeros(self.cache_shape(num_blocks), dtype=self.torch_dtype, device=device)

    def describe(self) -> str:
        """One line naming every field, for error messages."""
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())

    def mismatch(self, other: "KvLayout") -> str | None:
        """None when equal, else a message naming both layouts."""
        if self == other:
            return None
        return f"KV layouts differ: [{self.describe()}] vs [{other.describe()}]"


def layer_kv(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one layer's key and value caches: each (num_blocks, block_size, num_kv_heads, head_dim)."""
    return kv_cache[:, layer, 0], kv_cache[:, layer, 1]
