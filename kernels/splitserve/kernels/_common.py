"""Helpers shared by the kernel files: implementation dispatch, launch arithmetic, and the shape checks
and cache gather the two paged attention ops share.

Every op file exposes `<op>(..., impl="auto")`. `impl` is one of:
  "auto"   - Triton when the first tensor argument is on CUDA, the torch reference otherwise;
  "triton" - always Triton (on CPU this needs TRITON_INTERPRET=1 set before import);
  "ref"    - always the plain-torch reference.
"""

from __future__ import annotations

import functools

import torch

IMPLS = ("auto", "triton", "ref")


def use_triton(impl: str, tensor: torch.Tensor, op_name: str) -> bool:
    """True when `op_name` should run its Triton kernel for inputs living where `tensor` lives."""
    if impl == "auto":
        return tensor.is_cuda
    if impl == "triton":
        return True
    if impl == "ref":
        return False
    raise ValueError(f"{op_name}: impl={impl!r} is not one of {IMPLS}")


def interpreting(tensor: torch.Tensor) -> bool:
    """Triton kernels on CPU tensors can only run under the interpreter (TRITON_INTERPRET=1).

    The interpreter computes `tl.dot` on bf16 wrongly, so kernels upcast dot operands when this is
    true; on a GPU they keep the 16-bit tensor-core path.
    """
    return not tensor.is_cuda


def fp8_dot_f16(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Attention over an fp8 (e4m3) cache with a 16-bit q: dot in float16 (q cast once, tiles upcast by one
    packed convert per two values; bf16 would take a second convert each). A float32 q keeps float32 dots."""
    return k_cache.dtype == torch.float8_e4m3fn and q.dtype in (torch.float16, torch.bfloat16)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def dot_precision(dtype: torch.dtype) -> str:
    """Triton dot input precision: exact fp32 ("ieee") for fp32 inputs instead of Triton's TF32 default."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_paged_attention_shapes(op_name: str, q_dims: str, q, k_cache, v_cache) -> None:
    """q (3-d, `q_dims` names its axes in the message) against caches (num_blocks, block_size, Hkv, D):
    both caches one shape, query heads a multiple of KV heads, one head_dim."""
    if q.dim() != 3:
        raise ValueError(f"{op_name}: q must be {q_dims}, got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"{op_name}: caches must both be (num_blocks, block_size, Hkv, D), "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{op_name}: query heads {num_q_heads} must be a multiple of KV heads {num_kv_heads}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"{op_name}: q head_dim {q.shape[2]} != cache head_dim {k_cache.shape[3]}")


def check_sinks_window(op_name: str, num_q_heads: int, sinks, sliding_window: int | None) -> None:
    """gpt-oss's extras: sinks one logit per query head, a window of at least one position."""
    if sinks is not None and tuple(sinks.shape) != (num_q_heads,):
        raise ValueError(f"{op_name}: sinks must be ({num_q_heads},) (one per query head), got {tuple(sinks.shape)}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{op_name}: sliding_window must be at least 1, got {sliding_window}")


def gather_sequence_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `seq_len` cached keys and values of one sequence (its block table row), as fp32 copies
    (L, Hkv, D): what the torch references attend over."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    ids = block_table[: -(-seq_len // k_cache.shape[1])].long()
    k = k_cache[ids].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()  # (L, Hkv, D)
    v = v_cache[ids].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
    return k, v
