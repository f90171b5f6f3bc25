"""Bring a tensor's bytes into the GPU's L2 cache ahead of the kernel that reads them (Hopper and later).

    l2_prefetch(t, nbytes)    the first `nbytes` of t's storage (all of it by default) asked into L2;
                              nothing is read into registers, nothing is written, the call returns at once

Why: a decode step of a few rows streams each projection's weight from HBM, but between the projections
run kernels that read little (rotary, the KV write, attention over a short cache at batch 1, RMSNorm):
HBM idles for ~8 us a layer of an 8B model while they run. Asked for the next projection's weight on a
side stream during that window (engine.fused_ops.WeightPrefetch), the projection then reads it from L2.

How: each program lane issues one `cp.async.bulk.prefetch.L2.global` (sm_90: a bulk request of up to
CHUNK bytes, 16-byte aligned, a multiple of 16 long) for its chunk and the program exits; the memory
system fetches in the background. MODE "ld" instead loads the chunk into registers with an L2
evict-last hint and stores one word per program into `sink` (kept for devices or a Triton without the
bulk instruction, and to measure the two against each other).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # bytes one lane asks for
LANES = 128  # lanes (chunks) per program
MODES = ("bulk", "ld")


@triton.jit
def _l2_prefetch_kernel(ptr, sink_ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr, BULK: tl.constexpr):
    pid = tl.program_id(0)
    if BULK:
        chunk = pid.to(tl.int64) * LANES + tl.arange(0, LANES)  # (LANES,)
        start = chunk * CHUNK
        size = tl.minimum(nbytes - start, CHUNK)  # <= 0 past the end
        size = (tl.maximum(size, 0) // 16 * 16).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p;\nsetp.gt.s32 p, $2, 0;\n@p cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0; }",
            "=r,l,r",
            [ptr + start, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        offs = pid.to(tl.int64) * (LANES * CHUNK) + tl.arange(0, LANES * CHUNK // 4).to(tl.int64) * 4
        words = tl.load(
            (ptr + offs).to(tl.pointer_type(tl.int32)), mask=offs < nbytes, other=0, eviction_policy="evict_last"
        )
        tl.store(sink_ptr + pid, tl.sum(words, axis=0))


def l2_prefetch(t: torch.Tensor, nbytes: int | None = None, mode: str = "bulk", sink: torch.Tensor | None = None):
    """Ask for the first `nbytes` (default: all; whole 16-byte units) of contiguous CUDA tensor `t` in L2 (module
    docstring). Mode "ld" needs `sink`: int32, at least cdiv(nbytes, CHUNK * LANES) entries, where program i
    stores the int32 sum of its words (it also runs under the Triton interpreter, which the tests use)."""
    if mode not in MODES:
        raise ValueError(f"l2_prefetch: mode {mode!r} is not one of {MODES}")
    if not t.is_contiguous():
        raise ValueError(f"l2_prefetch: t must be contiguous, got strides {t.stride()}")
    if mode == "bulk" and not t.is_cuda:
        raise ValueError(f"l2_prefetch: mode 'bulk' needs a CUDA tensor, got device {t.device}")
    total = t.numel() * t.element_size()
    nbytes = (total if nbytes is None else min(int(nbytes), total)) // 16 * 16  # whole 16-byte units
    if nbytes <= 0:
        return
    programs = triton.cdiv(nbytes, CHUNK * LANES)
    flat = t.view(-1).view(torch.uint8)
    if mode == "ld":
        if sink is None or sink.dtype != torch.int32 or sink.numel() < programs:
            raise ValueError(f"l2_prefetch: mode 'ld' needs an int32 sink of at least {programs} entries")
    else:
        sink = flat  # unused
    _l2_prefetch_kernel[(programs,)](flat, sink, nbytes, CHUNK=CHUNK, LANES=LANES, BULK=mode == "bulk", num_warps=4)
