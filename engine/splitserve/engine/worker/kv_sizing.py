"""How many KV blocks an engine allocates: per-instance accounting and a cap (pure arithmetic).

Several instances may share one GPU (`splitserve up` on one GPU runs a prefill and a decode on
`cuda:0`), so `kv_cache_memory_fraction` bounds what *this process* allocates, as vLLM's
`--gpu-memory-utilization` does, never what the whole GPU holds:

    instance  = total × fraction
    kv budget = instance − own (this process's allocator: weights, buffers) − NON_TORCH − RESERVE
    kv        = min(kv budget, cap)        cap = 2 × max_num_seqs × ⌈max_model_len / block_size⌉ blocks
    refused   when kv + RESERVE exceeds what is free on the device now (other processes hold the rest)

The cap keeps a small model from taking the whole GPU (and minutes of zeroing): half of it is
the most the running batch can use, the other half keeps freed prefixes cached. `--num-kv-blocks`
sets the pool explicitly and bypasses all of this. On CPU the budget is `kv_cache_cpu_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20
# Outside torch's allocator: the CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers (docs/performance.md,
# "Findings that set defaults").
NON_TORCH_BYTES = 512 * MiB
# Allocated after the pool: activations of a max_num_batched_tokens step, logits, CUDA graphs,
# transfer staging.
RESERVE_BYTES = 1 * GiB


class KvSizingError(ValueError):
    """The pool cannot be sized as configured; the message names the flag, the numbers and the fix."""


@dataclass(frozen=True)
class DeviceMemory:
    """A CUDA device's memory as this process sees it at sizing time (bytes)."""

    total_bytes: int
    free_bytes: int  # free on the device now, whoever holds the rest
    own_bytes: int  # held by this process's allocator (torch.cuda.memory_reserved)


def cap_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """The largest pool sized from memory: the running batch's worth of blocks, twice."""
    return 2 * max_num_seqs * -(-max_model_len // block_size)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB"


def gpu_kv_blocks(memory: DeviceMemory, fraction: float, block_nbytes: int, cap: int, device: str) -> int:
    """Blocks for a CUDA pool under per-instance accounting (see the module docstring)."""
    instance = int(memory.total_bytes * fraction)
    budget = instance - memory.own_bytes - NON_TORCH_BYTES - RESERVE_BYTES
    if budget < block_nbytes:
        raise KvSizingError(
            f"--kv-cache-memory-fraction {fraction:g} gives this instance {_gib(instance)} of {device}'s "
            f"{_gib(memory.total_bytes)}; its weights and buffers take {_gib(memory.own_bytes)} and "
            f"{_gib(NON_TORCH_BYTES + RESERVE_BYTES)} stays for the CUDA context, activations and graphs, "
            f"leaving {_gib(max(budget, 0))}: not one KV block of {block_nbytes} bytes. Raise "
            "--kv-cache-memory-fraction, or set --num-kv-blocks"
        )
    num_blocks = min(budget // block_nbytes, cap)
    kv_bytes = num_blocks * block_nbytes
    if kv_bytes + RESERVE_BYTES > memory.free_bytes:
        others = memory.total_bytes - memory.free_bytes - memory.own_bytes
        raise KvSizingError(
            f"the KV pool of {num_blocks} blocks ({_gib(kv_bytes)}, from --kv-cache-memory-fraction "
            f"{fraction:g} of {device}'s {_gib(memory.total_bytes)}) and {_gib(RESERVE_BYTES)} for activations "
            f"need more than the {_gib(memory.free_bytes)} free now (other processes hold about "
            f"{_gib(max(others, 0))}): lower --kv-cache-memory-fraction of this or the other instances on "
            f"{device}, or set --num-kv-blocks"
        )
    return num_blocks


def cpu_kv_blocks(cpu_bytes: int, block_nbytes: int, cap: int) -> int:
    """Blocks for a CPU pool: kv_cache_cpu_bytes, capped."""
    if cpu_bytes < block_nbytes:
        raise KvSizingError(
            f"--kv-cache-cpu-bytes {cpu_bytes} holds no KV block of {block_nbytes} bytes: "
            "raise it, or set --num-kv-blocks"
        )
    return min(cpu_bytes // block_nbytes, cap)
