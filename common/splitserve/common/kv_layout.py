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

An fp8 cache (dtype "float8_e4m3fn") stores k / k_scale and v / v_scale with one scale pair
per layer (`k_scales[l]`, `v_scales[l]`): part of the layout, since blocks written under one
scale mean other values under another. Other dtypes have no scales (empty tuples).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

LAYOUT_NAME = "block_major_v1"

# KV dtype name -> bytes per element (the engine maps the names to torch dtypes)
DTYPE_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1}
FP8_KV_DTYPE = "float8_e4m3fn"  # what --kv-cache-dtype fp8 stores


@dataclass(frozen=True)
class KvLayout:
    """Shape and identity of a worker's KV cache (see the module docstring); torch-free.

    dtype is a key of DTYPE_ITEMSIZE; `splitserve.engine.worker.kv_cache` maps it to a torch dtype
    and allocates the cache. k_scales / v_scales: one per layer for an fp8 dtype, else empty.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    model_id: str
    layout: str = LAYOUT_NAME
    k_scales: tuple[float, ...] = ()
    v_scales: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        wanted = self.num_layers if self.dtype == FP8_KV_DTYPE else 0
        if len(self.k_scales) != wanted or len(self.v_scales) != wanted:
            raise ValueError(
                f"KV layout of dtype {self.dtype}: {len(self.k_scales)} k_scales and {len(self.v_scales)} v_scales, "
                f"expected {wanted} of each"
            )

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
        """One line naming every field, for error messages (see describe_layout_fields)."""
        return describe_layout_fields(asdict(self))

    def mismatch(self, other: KvLayout) -> str | None:
        """None when equal, else a message naming both layouts."""
        if self == other:
            return None
        return f"KV layouts differ: [{self.describe()}] vs [{other.describe()}]"


def describe_layout_fields(fields: dict) -> str:
    """`name=value, ...` of a layout's fields; empty scale lists are left out, and a scale list
    shows as `value x layers` when every layer has the same scale (`k_scales=1x28`)."""
    shown = []
    for name, value in fields.items():
        if isinstance(value, (tuple, list)):
            if not value:
                continue
            values = [float(v) for v in value]
            if len(set(values)) == 1:
                value = f"{values[0]:g}x{len(values)}"
            else:
                value = "[" + ",".join(f"{v:g}" for v in values) + "]"
        shown.append(f"{name}={value}")
    return ", ".join(shown)
