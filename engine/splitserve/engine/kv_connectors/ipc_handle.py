"""CUDA IPC handles as text that is safe to take off the network.

torch shares a CUDA tensor between processes as `(rebuild_cuda_tensor, args)`; pickling that names code,
so unpickling a handle from a peer would run whatever the peer put there. A handle travels here as the
plain fields of `args` instead (ints, bytes, a dtype name), pickled and read back with no globals allowed,
and every field is checked before torch sees it: torch's native code trusts them (the reference-counter
name and offset are a file in /dev/shm and a word in it that torch decrements; sizes and offsets place
the mapping).

    text = export_cuda_ipc(pool)                            # the owner
    args = load_cuda_ipc(text)                              # anyone: plain fields, each checked
    check_shape(args, shape, dtype)                         # the reader knows what it expects
    tensor = rebuild(args)                                  # maps it
"""

from __future__ import annotations

import base64
import io
import pickle
import re

import torch

# torch's reduce_tensor arguments less its two classes, each field's type
FIELDS = (
    ("size", tuple),
    ("stride", tuple),
    ("offset", int),
    ("dtype", str),
    ("device", int),
    ("handle", bytes),
    ("storage_size_bytes", int),
    ("storage_offset_bytes", int),
    ("requires_grad", bool),
    ("ref_counter_handle", bytes),
    ("ref_counter_offset", int),
    ("event_handle", bytes),
    ("event_sync_required", bool),
)
DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
REF_COUNTER_NAME = re.compile(rb"/torch_\d{1,10}_\d{1,20}_\d{1,20}")  # at::NewProcessWideShmHandle()
REF_COUNTER_SLOTS = 10000  # torch's CUDA_IPC_REF_COUNTER_FILE_SIZE
EVENT_HANDLE_BYTES = 64  # cudaIpcEventHandle_t
MAX_HANDLE_BYTES = 4096
MAX_DIMS = 8


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"a CUDA IPC handle holds plain data only, not {module}.{name}")


def plain_args(args: tuple) -> tuple:
    """torch's reduce_tensor arguments of a CUDA tensor -> the plain fields of FIELDS."""
    tensor_cls, size, stride, offset, storage_cls, dtype, *rest = args
    if tensor_cls is not torch.Tensor or storage_cls is not torch.storage.TypedStorage:
        raise ValueError(
            f"only plain tensors are exported over CUDA IPC, not {tensor_cls.__name__} on {storage_cls.__name__}"
        )
    return (tuple(size), tuple(stride), offset, str(dtype).removeprefix("torch."), *rest)


def _bad(name: str, value, limit: str) -> ValueError:
    return ValueError(f"endpoint.cuda_ipc field {name} {value!r:.80} is out of range: {limit}")


def rebuild_args(plain) -> tuple:
    """The plain fields, each checked -> torch's rebuild_cuda_tensor arguments."""
    if not isinstance(plain, tuple) or len(plain) != len(FIELDS):
        raise ValueError(
            f"endpoint.cuda_ipc must hold {len(FIELDS)} fields, got "
            f"{len(plain) if isinstance(plain, tuple) else type(plain).__name__}"
        )
    for (name, kind), value in zip(FIELDS, plain):
        if type(value) is not kind or kind is tuple and not all(type(v) is int for v in value):
            raise ValueError(f"endpoint.cuda_ipc field {name} must be {kind.__name__}, got {value!r:.80}")
    (
        size,
        stride,
        offset,
        dtype_name,
        device,
        handle,
        storage_size,
        storage_offset,
        requires_grad,
        ref_name,
        ref_offset,
        event_handle,
        _sync,
    ) = plain
    dtype = DTYPES.get(dtype_name)
    if dtype is None:
        raise ValueError(f"endpoint.cuda_ipc field dtype {dtype_name!r} is not a torch dtype")
    if not 0 < len(size) <= MAX_DIMS or len(stride) != len(size) or min(size) < 1 or min(stride) < 0:
        raise _bad("size", size, f"1-{MAX_DIMS} positive dimensions, as many non-negative strides")
    if offset < 0 or storage_offset < 0 or device < 0:
        raise _bad("offset", (offset, storage_offset, device), "offsets and device must be >= 0")
    extent = (offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1) * dtype.itemsize
    if not extent <= storage_size:
        raise _bad("storage_size_bytes", storage_size, f"must hold the tensor's {extent} bytes")
    if not 0 < len(handle) <= MAX_HANDLE_BYTES:
        raise _bad("handle", len(handle), f"1-{MAX_HANDLE_BYTES} bytes")
    if requires_grad:
        raise _bad("requires_grad", requires_grad, "shared KV never requires grad")
    if not REF_COUNTER_NAME.fullmatch(ref_name) or not 0 <= ref_offset < REF_COUNTER_SLOTS:
        raise _bad(
            "ref_counter_handle", (ref_name, ref_offset), f"/torch_<pid>_<n>_<n> and a slot in [0, {REF_COUNTER_SLOTS})"
        )
    if len(event_handle) != EVENT_HANDLE_BYTES:
        raise _bad("event_handle", len(event_handle), f"exactly {EVENT_HANDLE_BYTES} bytes")
    return (torch.Tensor, torch.Size(size), stride, offset, torch.storage.TypedStorage, dtype, *plain[4:])


def export_cuda_ipc(tensor: torch.Tensor) -> str:
    """A CUDA tensor's IPC handle as text (what an endpoint carries)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    func, args = reduce_tensor(tensor)
    if func is not rebuild_cuda_tensor:
        raise ValueError(f"only CUDA tensors are exported over CUDA IPC, not one on {tensor.device}")
    return base64.b64encode(pickle.dumps(plain_args(args))).decode()


def load_cuda_ipc(text: str) -> tuple:
    """rebuild_cuda_tensor's arguments from `export_cuda_ipc`'s text, checked before anything runs."""
    if not isinstance(text, str) or len(text) > 4 * MAX_HANDLE_BYTES:
        raise ValueError(f"endpoint.cuda_ipc is not a CUDA IPC handle: over {4 * MAX_HANDLE_BYTES} characters")
    try:
        raw = base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        raise ValueError("endpoint.cuda_ipc is not a CUDA IPC handle: not base64 text") from None
    try:
        plain = _PlainUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # untrusted bytes: any unpickling failure is a malformed handle
        raise ValueError(f"endpoint.cuda_ipc is not a CUDA IPC handle: {exc}") from None
    return rebuild_args(plain)


def check_shape(args: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """The handle must be exactly a contiguous tensor of `shape` and `dtype` filling its storage, on a
    device this process sees (what a KV pool of known layout and block count is)."""
    size, stride, offset, got_dtype, device, storage_size = tuple(args[1]), args[2], args[3], args[5], args[6], args[8]
    strides, numel = [], 1
    for n in reversed(shape):
        strides.append(numel)
        numel *= n
    contiguous = tuple(reversed(strides))
    if (
        size != tuple(shape)
        or tuple(stride) != contiguous
        or offset != 0
        or got_dtype != dtype
        or storage_size != numel * dtype.itemsize
    ):
        raise ValueError(
            f"endpoint.cuda_ipc describes a {got_dtype} tensor of size {size} (stride {tuple(stride)}, "
            f"offset {offset}, {storage_size} bytes), not the contiguous {dtype} pool of size "
            f"{tuple(shape)} ({numel * dtype.itemsize} bytes) its layout and num_blocks give"
        )
    if device >= torch.cuda.device_count():
        raise _bad("device", device, f"this process sees {torch.cuda.device_count()} CUDA devices")


def rebuild(args: tuple) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(*args)


def open_cuda_ipc(text: str) -> torch.Tensor:
    """Map another process's CUDA tensor from `export_cuda_ipc`'s text (fields checked, shape not)."""
    return rebuild(load_cuda_ipc(text))
