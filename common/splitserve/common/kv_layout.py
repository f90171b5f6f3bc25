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

Tensor parallel: each of `tensor_parallel_size` ranks keeps a pool of this shape holding `num_kv_heads`
of the model's KV heads; `rank_kv_heads[r]` names rank r's (the model's head indices). Where the model has
fewer KV heads than ranks, a head is held by several ranks. A block id names the same block on every
rank. `transfer_plan` maps a decode's ranks to the prefill ranks holding their heads.

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
    tensor_parallel_size: int = 1
    rank_kv_heads: tuple[tuple[int, ...], ...] = ()  # per rank, its KV heads; empty at tensor_parallel_size 1

    def __post_init__(self) -> None:
        size = self.tensor_parallel_size
        if size < 1 or (size == 1 and self.rank_kv_heads) or (size > 1 and len(self.rank_kv_heads) != size):
            raise ValueError(
                f"KV layout of tensor_parallel_size {size}: {len(self.rank_kv_heads)} rank_kv_heads entries, "
                f"expected {size if size > 1 else 0}"
            )
        if any(len(heads) != self.num_kv_heads for heads in self.rank_kv_heads):
            raise ValueError(f"KV layout: every rank_kv_heads entry must name num_kv_heads={self.num_kv_heads} heads")
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

    def heads_of_rank(self, rank: int) -> tuple[int, ...]:
        """The model's KV heads rank `rank`'s pool holds, in pool order."""
        return self.rank_kv_heads[rank] if self.rank_kv_heads else tuple(range(self.num_kv_heads))


# A decode rank's part of a plan: (its pool's head index, prefill rank, that rank's pool head index) per head.
RankPlan = tuple[tuple[int, int, int], ...]
_SAME_IN_A_PLAN = ("num_layers", "head_dim", "block_size", "dtype", "model_id", "layout", "k_scales", "v_scales")


def transfer_plan(prefill: KvLayout, decode: KvLayout) -> tuple[RankPlan, ...]:
    """Where each decode rank pulls each of its KV heads from: one `RankPlan` per decode rank. A head several
    prefill ranks hold is taken from them in turn across decode ranks (spreading the reads). ValueError naming
    both layouts when they cannot map: another model, dtype, block or head shape, or a head no prefill rank holds.
    """
    differ = [name for name in _SAME_IN_A_PLAN if getattr(prefill, name) != getattr(decode, name)]
    if differ:
        raise ValueError(f"KV layouts cannot map ({', '.join(differ)} differ): {_both(prefill, decode)}")
    holders: dict[int, list[tuple[int, int]]] = {}  # model head -> [(prefill rank, its pool index)]
    for rank in range(prefill.tensor_parallel_size):
        for index, head in enumerate(prefill.heads_of_rank(rank)):
            holders.setdefault(head, []).append((rank, index))
    plans = []
    for rank in range(decode.tensor_parallel_size):
        plan = []
        for index, head in enumerate(decode.heads_of_rank(rank)):
            sources = holders.get(head)
            if not sources:
                raise ValueError(
                    f"KV layouts cannot map (decode rank {rank}'s head {head} is on no prefill rank): "
                    f"{_both(prefill, decode)}"
                )
            plan.append((index, *sources[rank % len(sources)]))
        plans.append(tuple(plan))
    return tuple(plans)


def _both(prefill: KvLayout, decode: KvLayout) -> str:
    return f"prefill [{prefill.describe()}] vs decode [{decode.describe()}]"


def describe_layout_fields(fields: dict) -> str:
    """`name=value, ...` of a layout's fields; empty scale lists and tensor_parallel_size 1 are left out, a
    scale list shows as `value x layers` when every layer has the same scale (`k_scales=1x28`), and each
    rank's KV heads as `[0,1][2,3]`."""
    shown = []
    for name, value in fields.items():
        if name == "tensor_parallel_size" and value in (0, 1):
            continue
        if name == "rank_kv_heads":
            if value:
                shown.append(f"{name}=" + "".join("[" + ",".join(str(h) for h in heads) + "]" for heads in value))
            continue
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
