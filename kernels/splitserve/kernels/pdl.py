"""Programmatic dependent launch (PDL, compute capability 9.0+) for the decode step's small kernels.

A kernel launched with PDL may be scheduled while the kernel before it on the stream is still finishing: its
programs start, wait at `griddepcontrol.wait` until that kernel has completed and its writes are visible, then
signal that the kernel after them may be scheduled in turn. Every kernel that opts in calls `pdl_prologue`
before its first memory access, so it reads and writes nothing early: the gain is the launch latency between
two kernels (at batch 1 an 8B decode graph is ~350 launches of a few microseconds each), not overlapped work.
A kernel launched without PDL (cuBLAS, torch ops) waits for the whole previous kernel as always, and
`griddepcontrol.wait` returns at once when nothing precedes it programmatically, so the chain may mix both.

    pdl_launch(t)      {"PDL": constexpr, ["launch_pdl": True]} to splat into a launch on t's device
    pdl_prologue(PDL)  at the top of the kernel: wait for the previous kernel, then let the next one launch

ENABLED is on: measured faster, tokens unchanged (docs/performance.md, "Findings that set defaults").
benchmarks/offline_throughput.py's `:nopdl` variants turn it off to measure again.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = True


@functools.cache
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def pdl_launch(t: torch.Tensor) -> dict:
    """The launch arguments of a PDL-aware kernel for tensors on t's device: PDL on for NVIDIA CUDA devices of
    capability 9.0+ while ENABLED, else the constexpr False and no launch option (the interpreter takes none, even
    over CUDA tensors; a ROCm build's devices report other capabilities)."""
    if ENABLED and t.is_cuda and torch.version.hip is None and os.environ.get("TRITON_INTERPRET") != "1":
        if _capable(t.device.index if t.device.index is not None else torch.cuda.current_device()):
            return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """Wait for the previous kernel on the stream (its writes visible), then allow the next one to launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
