"""Triton kernels for the GPU data path, one op per file, each with a plain-torch reference.

Every op takes `impl="auto"` (Triton on CUDA tensors, the reference elsewhere), "triton" (forced;
on CPU it needs TRITON_INTERPRET=1 set before this package is imported) or "ref".
Nothing here imports from `engine`.
"""

from splitserve.kernels.activation import silu_and_mul
from splitserve.kernels.kv_write import write_kv
from splitserve.kernels.paged_decode_attention import paged_decode_attention
from splitserve.kernels.paged_prefill_attention import paged_prefill_attention
from splitserve.kernels.rmsnorm import rms_norm
from splitserve.kernels.rotary import build_cos_sin_cache, rotary_embedding

__all__ = [
    "build_cos_sin_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv",
]
