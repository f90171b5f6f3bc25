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

LAYOUT_NAME = "block_major_v1"

# KV dtype name -> bytes per element (the engine maps the names to torch dtypes)
DTYPE_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


@dataclass(frozen=True)
class KvLayout:
    """Shape and identity of a worker's KV cache (see the module docstring); torch-free.

    dtype is a key of DTYPE_ITEMSIZE; `splitserve.engine.kv_layout` maps it to a torch dtype
    and allocates the cache.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    model_id: str
    layout: str = LAYOUT_NAME

    @property
    def block_numel(self) -> int:
        """Elements in one block (all layers, K and V)."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def block_nbytes(self) -> int:
        try:
            return self.block_numel * DTYPE_ITEMSIZE[self.dtype]
        except KeyError:
            raise ValueError(
                f"KV dtype {self.dtype!r} is not supported; choose one of {sorted(DTYPE_ITEMSIZE)}"
            ) from None

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)"""
        return (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def describe(self) -> str:
        """One line naming every field, for error messages."""
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())

    def mismatch(self, other: KvLayout) -> str | None:
        """None when equal, else a message naming both layouts."""
        if self == other:
            return None
        return f"KV layouts differ: [{self.describe()}] vs [{other.describe()}]"
