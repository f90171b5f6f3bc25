"""Packed float32 GEMMs on the CPU: y = x W^T (+ b), the weight reordered once for a library's kernel.

torch's CPU builds carry two libraries with a packed-weight linear: oneDNN (`torch.ops.mkldnn`) and MKL
(`torch.ops.mkl`). `SPLITSERVE_CPU_GEMM` picks one: auto | onednn | mkl | off (`SPLITSERVE_CPU_PACKED=0`
is off too: plain F.linear). auto is MKL on Intel CPUs, where it beats F.linear at decode batch sizes, and
oneDNN on others, where MKL ran a decode step's projections slower than oneDNN and its own threads scaled poorly
past one (docs/performance.md, "Findings that set defaults").
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

BATCH_HINT = 64  # both libraries pack for this GEMM height; every batch size works with the packed weight


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _mkl_available() -> bool:
    return hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor string (GenuineIntel, AuthenticAMD, ...), or "" where /proc/cpuinfo has none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def chosen_library() -> str | None:
    """onednn, mkl, or None (plain F.linear): SPLITSERVE_CPU_GEMM, else by vendor as the module says."""
    if os.environ.get("SPLITSERVE_CPU_PACKED", "1").lower() in ("0", "false", "off"):
        return None
    wanted = os.environ.get("SPLITSERVE_CPU_GEMM", "auto").strip().lower() or "auto"
    available = {"onednn": _onednn_available(), "mkl": _mkl_available()}
    if wanted == "off":
        return None
    if wanted == "auto":
        order = ("mkl", "onednn") if cpu_vendor() == "GenuineIntel" else ("onednn", "mkl")
        return next((lib for lib in order if available[lib]), None)
    if wanted not in available:
        raise ValueError(f"SPLITSERVE_CPU_GEMM={wanted!r}: choose one of auto, onednn, mkl, off")
    if not available[wanted]:
        raise ValueError(f"SPLITSERVE_CPU_GEMM={wanted}: this torch build has no {wanted} packed linear")
    return wanted


@dataclass(frozen=True)
class PackedWeight:
    """A float32 CPU weight (out, in) packed for `library`; calling it on x (T, in) gives x W^T + b (T, out)."""

    library: str
    packed: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.library == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, x.shape[0])


_PACKERS = {
    "onednn": lambda w: torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT),
    "mkl": lambda w: torch.ops.mkl._mkl_reorder_linear_weight(w, BATCH_HINT),
}


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight | None:
    """The weight packed for chosen_library(), or None where packing does not apply (not a float32 CPU
    weight, or packing off / unavailable): the caller keeps F.linear."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    library = chosen_library()
    if library is None:
        return None
    return PackedWeight(library, _PACKERS[library](weight), weight, bias)
