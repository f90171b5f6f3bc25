"""Helpers shared by the kernel files: implementation dispatch and launch arithmetic.

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


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H200)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def check_same_dtype(op_name: str, **tensors: torch.Tensor) -> None:
    """Fail with the names and dtypes when the given tensors disagree on dtype."""
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{name}={dt}" for name, dt in dtypes.items())
        raise ValueError(f"{op_name}: dtypes must match, got {listed}")


def dot_precision(dtype: torch.dtype) -> str:
    """Triton dot input precision: exact fp32 ("ieee") for fp32 inputs instead of Triton's TF32 default."""
    return "ieee" if dtype == torch.float32 else "tf32"
