"""What an engine starts on: its device and dtype, the default step token budget for the device, glibc's heap kept
for the next step (CPU), and the tensor-parallel ranks 1..N-1 (worker/tp_worker.py).
"""

from __future__ import annotations

import torch

from splitserve.common.config import EngineConfig, default_max_num_batched_tokens
from splitserve.common.config_fields import ConfigError
from splitserve.engine.outputs import RequestError


def resolve_device(name: str) -> torch.device:
    """The torch device of --device `name` ("auto": CUDA when visible); a CUDA device becomes the current one."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"  # then as if named: cuda gets its index
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RequestError(f"--device {name} was asked for but no CUDA device is visible")
    device = torch.device(name)
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)  # other GPUs stay visible (CUDA IPC peers)
    return device


def resolve_dtype(name: str, device: torch.device) -> str:
    """The dtype name of --dtype `name` ("auto": bfloat16 on CUDA, float32 on the CPU)."""
    if name == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    return name


def start_tp_workers(config: EngineConfig, model_config, device: torch.device, dtype_name: str, max_num_seqs: int):
    """Ranks 1..N-1 of --tensor-parallel-size N, each loading its shard as rank 0 does (worker/rank_setup.py);
    `max_num_seqs`: rank 0's resolved cap, which sizes every rank's pool alike."""
    import functools

    from splitserve.engine.worker.rank_setup import set_up_rank
    from splitserve.engine.worker.tensor_parallel import check_shardable
    from splitserve.engine.worker.tp_worker import TpWorkers

    moe = getattr(model_config, "moe", None)
    check_shardable(
        model_config.num_heads,
        model_config.num_kv_heads,
        model_config.intermediate_size,
        config.tensor_parallel_size,
        moe.intermediate_size if moe is not None else 0,
    )
    if device.type == "cuda" and device.index + config.tensor_parallel_size > torch.cuda.device_count():
        raise ConfigError(
            f"--tensor-parallel-size {config.tensor_parallel_size} from {device} needs GPUs {device.index}.."
            f"{device.index + config.tensor_parallel_size - 1}; {torch.cuda.device_count()} are visible"
        )
    return TpWorkers.start(
        functools.partial(set_up_rank, config, model_config, dtype_name, max_num_seqs),
        config.tensor_parallel_size,
        device,
    )


def default_budget(device: torch.device, offline: bool) -> int:
    """The step's token budget for an unset --max-num-batched-tokens on `device` (common/config.py's rule)."""
    if device.type != "cuda":
        return default_max_num_batched_tokens("cpu", 0, "", offline)
    props = torch.cuda.get_device_properties(device)
    return default_max_num_batched_tokens("cuda", props.total_memory, props.name, offline)


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> bool:
    """Make glibc keep and reuse freed tensor memory (process-wide; CPU engines).

    By default a tensor over the mmap threshold gets fresh pages from the kernel and gives them
    back when freed, so every step's activations page-fault again (RMSNorm 6x slower at 2k-token steps:
    docs/performance.md, "Findings that set defaults"). With the threshold at its maximum
    (32 MiB) and trimming at 1 GiB, freed blocks stay in the heap for the next step, as tcmalloc
    would keep them. Returns False where the C library has no mallopt (not glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
