"""y = x (W_q * scale)^T (+ b) for a few rows, the weight in e4m3 and x kept in 16 bits (W8A16).

    x (M, K) bf16/fp16/fp32, M <= MAX_ROWS      activations as they are: no per-token quantization
    w_q (N, K) float8_e4m3fn, scale (N,) fp32   one scale per output row (engine.worker.fp8's weights)
    y[m, n] = scale[n] * sum_k x[m, k] * w_q[n, k]  (+ b[n])          fp32 sums, rounded once to x's dtype

Why: at a decode step of a few rows the projections are bound by the weight bytes they read. The
e4m3 GEMM (`torch._scaled_mm`) at one row plus the activation quantizer in front of it was slower
than cuBLAS bf16 (docs/performance.md, "FP8"); this kernel streams the one-byte
weight once and upcasts it in registers, so nothing but the weight's bytes moves.

Two inner loops (constexpr DOT):
  M == 1  GEMV: each program multiplies a (BLOCK_N, BLOCK_K) weight tile by x's row with fp32 FMAs
          into a (BLOCK_N, BLOCK_K) accumulator, summed over K once after the loop;
  M > 1   tensor cores: the tile upcast to x's dtype, one (16, BLOCK_K) x (BLOCK_K, BLOCK_N) dot per step
          (16 FMAs a weight byte would make FMAs the bottleneck).
Split over K (SPLIT_K > 1) where N alone gives too few programs to keep every SM streaming:

    grid (N / BLOCK_N, SPLIT_K)         program (j, s) sums k in [s * K_PER_SPLIT, (s + 1) * K_PER_SPLIT)
    partials (SPLIT_K, M, N) fp32       each program stores its sums, then adds 1 to counters[j];
                                        the program that sees SPLIT_K - 1 adds the SPLIT_K partials in
                                        split order, scales, writes y and sets counters[j] back to 0

A 16-bit weight (the dtype of x, no scale: `weight_scale` None) runs the same loops; at one row that is a
bf16/fp16 GEMV measured against cuBLAS for the batch-1 decode step (engine.worker.fused_ops.gemv_tiles).

One launch, no host sync, a fixed grid per shape (CUDA-graph safe); the sum's order is fixed, so the
result does not depend on which program finishes last. `counters` (int32, zero) must outlive the call
and be used by one stream at a time (engine.worker.fp8.Fp8Linear owns one per layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._common import dot_precision, interpreting, num_sms, use_triton
from splitserve.kernels.pdl import pdl_launch, pdl_prologue

MAX_ROWS = 16  # rows of one tensor-core tile; more rows belong to a real GEMM
MIN_BLOCK_N = 16  # narrowest tile: `counters` needs cdiv(N, MIN_BLOCK_N) entries for any config
PROGRAMS_PER_SM = 4  # split K until the grid has about this many programs per SM (when K allows)


@triton.jit
def _finish(acc, rows, n, M, N, scale_ptr, b_ptr, y_ptr, stride_ym, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr):
    """acc (R, BLOCK_N) fp32 sums -> y rows `rows`, columns n: times the row scales, plus the bias."""
    n_mask = n < N
    out = acc
    if HAS_SCALE:
        out = acc * tl.load(scale_ptr + n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    mask = (rows < M)[:, None] & n_mask[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + n[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_skinny_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    K_PER_SPLIT,
    SPLIT_K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past N read row N - 1 (their sums are never stored): no mask on the weight loads; the weight is
    # read once, so its loads are evict_first (x and the partials stay in L2)
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1)
    rows = tl.arange(0, BLOCK_M)
    x_rows = x_ptr + rows[:, None] * stride_xm  # (BLOCK_M, 1)
    m_mask = (rows < M)[:, None]
    k_begin = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
            kk = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                w = tl.load(w_rows + kk[None, :], eviction_policy="evict_first")
                a = tl.load(x_rows + kk[None, :], mask=m_mask, other=0.0)
            else:
                w = tl.load(w_rows + kk[None, :], mask=(kk < K)[None, :], other=0.0, eviction_policy="evict_first")
                a = tl.load(x_rows + kk[None, :], mask=m_mask & (kk < K)[None, :], other=0.0)
            if DOT_F32:  # the interpreter's 16-bit dot is wrong (kernels._common.interpreting)
                acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision=PREC)
            else:
                acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=PREC)  # (BLOCK_M, BLOCK_N)
    else:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
            kk = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                w = tl.load(w_rows + kk[None, :], eviction_policy="evict_first")
                a = tl.load(x_ptr + kk)
            else:
                w = tl.load(w_rows + kk[None, :], mask=(kk < K)[None, :], other=0.0, eviction_policy="evict_first")
                a = tl.load(x_ptr + kk, mask=kk < K, other=0.0)
            acc2 += w.to(tl.float32) * a.to(tl.float32)[None, :]
        acc = tl.sum(acc2, axis=1)[None, :]  # (1, BLOCK_N)
    if not SPLIT:
        _finish(acc, rows, n, M, N, scale_ptr, b_ptr, y_ptr, stride_ym, HAS_BIAS, HAS_SCALE)
    else:
        store_mask = m_mask & (n < N)[None, :]
        part = part_ptr + rows[:, None] * N + n[None, :]  # (BLOCK_M, BLOCK_N) of partials[s]
        tl.store(part + pid_k * M * N, acc, mask=store_mask, cache_modifier=".cg")
        tl.debug_barrier()  # every thread's partials issued before the release below
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last of the tile's programs: the others' partials are visible
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(0, SPLIT_K):  # a runtime count: one compiled kernel for any split
                total += tl.load(part + s * M * N, mask=store_mask, other=0.0, cache_modifier=".cg")
            _finish(total, rows, n, M, N, scale_ptr, b_ptr, y_ptr, stride_ym, HAS_BIAS, HAS_SCALE)
            tl.store(count_ptr + pid_n, 0)  # ready for the next launch (a CUDA graph's replay too)


def split_k_for(n: int, k: int, block_n: int, block_k: int, sms: int) -> int:
    """Splits of K that bring the grid to about PROGRAMS_PER_SM programs a SM, each split a whole
    number of BLOCK_K steps (the count is then trimmed so that no split is empty)."""
    tiles, steps = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    want = max(1, min(steps, triton.cdiv(PROGRAMS_PER_SM * sms, tiles)))
    return triton.cdiv(steps, triton.cdiv(steps, want))


def fp8_skinny_config(
    m: int, n: int, k: int, sms: int, on_cpu: bool, dtype=torch.bfloat16, weight_bytes: int = 1
) -> dict:
    """Tiles for M rows of an (N, K) weight of `weight_bytes` (1: e4m3, 2: 16-bit) times x of `dtype`; the
    engine's tuned tiles override them (the tables under configs/, read by tuned_configs;
    benchmarks/kernel_timings.py --sections fp8linear sweeps the alternatives): GEMV tiles of 16 rows x 512 bytes
    (8 KiB a step, 3 in flight) and tensor-core tiles of 32 x 256; SPLIT_K from split_k_for. float32 x at M > 1
    takes 32 x 32: its exact dot is FMAs holding the whole K slice in registers, and at 32 x 256 it spilled
    to local memory (Triton 3.6, sm_90)."""
    if on_cpu:  # the interpreter: small tiles, so that tests cover several tiles and steps
        cfg = dict(DOT=m > 1, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1)
    elif m == 1:  # 8 KiB of weight a tile step whatever its dtype
        cfg = dict(DOT=False, BLOCK_N=16, BLOCK_K=512 // weight_bytes, num_warps=4, num_stages=3)
    elif dtype == torch.float32:
        cfg = dict(DOT=True, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=3)
    else:
        cfg = dict(DOT=True, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4)
    cfg["SPLIT_K"] = 1 if on_cpu else split_k_for(n, k, cfg["BLOCK_N"], cfg["BLOCK_K"], sms)
    return cfg


def fp8_skinny_linear_ref(x, weight, weight_scale, bias=None):
    """Plain torch, the same math: the e4m3 values times x in fp32 (fp64 for fp64 x), the row scale
    after the sum (none for a 16-bit weight), the bias, one rounding to x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    y = x.to(acc) @ weight.to(acc).t()  # (M, N)
    if weight_scale is not None:
        y = y * weight_scale.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def fp8_skinny_linear_error_bound(x, weight, weight_scale, bias=None) -> torch.Tensor:
    """(M, N): how far a correct kernel's result may lie from fp8_skinny_linear_ref's. Both round one fp32 sum
    to x's dtype, one step apart at most where the two sums straddle a boundary (2^-7 |y| in bf16, 2^-10 in
    fp16, 2^-23 in fp32); and they add in different orders (tensor-core tiles, split partials; Hopper's tensor
    cores also truncate their fp32 accumulation), each sum within 2 K 2^-24 of the exact one times the sum of
    |x_k w_k| scale, so the two within 4 K 2^-24. At K = 14,336 with one split that term exceeded a bf16 step
    where products cancel. The floor is the output dtype's smallest step."""
    acc = torch.promote_types(x.dtype, torch.float32)
    y = fp8_skinny_linear_ref(x, weight, weight_scale, bias).to(acc)
    step = torch.finfo(x.dtype).eps  # one step of x's dtype, relative
    magnitude = x.to(acc).abs() @ weight.to(acc).abs().t()
    if weight_scale is not None:
        magnitude = magnitude * weight_scale.to(acc)
    smallest = torch.finfo(x.dtype).tiny * torch.finfo(x.dtype).eps  # the dtype's smallest subnormal
    return step * y.abs() + 4 * x.shape[1] * 2.0**-24 * magnitude + smallest


def _check(x, weight, weight_scale, bias, counters, cfg=None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"fp8_skinny_linear: x must be (M, K) and weight (N, K), got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    sixteen = weight.dtype == x.dtype and x.dtype in (torch.float16, torch.bfloat16)
    if not (weight.dtype == torch.float8_e4m3fn or sixteen) or weight.stride(1) != 1:
        raise ValueError(
            "fp8_skinny_linear: weight must be float8_e4m3fn (or x's 16-bit dtype) with contiguous rows, got "
            f"{weight.dtype} with strides {weight.stride()} and x {x.dtype}"
        )
    n = weight.shape[0]
    if sixteen != (weight_scale is None):
        raise ValueError("fp8_skinny_linear: an e4m3 weight needs weight_scale, a 16-bit one takes none")
    if not sixteen and (weight_scale.shape != (n,) or weight_scale.dtype != torch.float32):
        raise ValueError(f"fp8_skinny_linear: weight_scale must be ({n},) float32, got {tuple(weight_scale.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"fp8_skinny_linear: bias must be ({n},), got {tuple(bias.shape)}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"fp8_skinny_linear: at most {MAX_ROWS} rows, got {x.shape[0]}; use a GEMM")
    if counters is not None and (counters.dtype != torch.int32 or counters.numel() < triton.cdiv(n, MIN_BLOCK_N)):
        raise ValueError(
            f"fp8_skinny_linear: counters must be int32 with at least {triton.cdiv(n, MIN_BLOCK_N)} entries"
        )
    if cfg is not None and (cfg["BLOCK_N"] < MIN_BLOCK_N or (not cfg["DOT"] and x.shape[0] > 1)):
        raise ValueError(f"fp8_skinny_linear: config {cfg} needs BLOCK_N >= {MIN_BLOCK_N} and DOT for M > 1")


def fp8_skinny_linear_triton(x, weight, weight_scale, bias=None, counters=None, config=None):
    """The Triton kernel; `config` overrides fp8_skinny_config (benchmarks and tests only).
    Without `counters` a zeroed set is made for this call."""
    m, k = x.shape[0], x.shape[1]
    n = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    on_cpu = interpreting(x)
    sms = 1 if on_cpu else num_sms(x.device.index if x.device.index is not None else torch.cuda.current_device())
    weight_bytes = weight.element_size()
    cfg = dict(fp8_skinny_config(m, n, k, sms, on_cpu, x.dtype, weight_bytes), **(config or {}))
    _check(x, weight, weight_scale, bias, counters, cfg)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    split = cfg["SPLIT_K"]
    steps = triton.cdiv(k, cfg["BLOCK_K"])
    k_per_split = triton.cdiv(steps, split) * cfg["BLOCK_K"]
    split = triton.cdiv(k, k_per_split)  # no empty split (a config may ask for more than K has)
    if split > 1:
        partials = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        if counters is None:
            counters = torch.zeros(triton.cdiv(n, MIN_BLOCK_N), dtype=torch.int32, device=x.device)
    else:
        partials = counters = y  # unused
    block_m = MAX_ROWS if cfg["DOT"] else 1
    _fp8_skinny_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split)](
        x,
        weight,
        weight_scale if weight_scale is not None else y,  # unused without a scale
        bias if bias is not None else y,  # unused without a bias
        y,
        partials,
        counters,
        m,
        n,
        k,
        k_per_split,
        split,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        HAS_SCALE=weight_scale is not None,
        DOT=cfg["DOT"],
        BLOCK_M=block_m,
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        SPLIT=split > 1,
        EVEN_K=k % cfg["BLOCK_K"] == 0,
        NUM_STAGES=cfg["num_stages"],
        DOT_F32=on_cpu,
        PREC="ieee" if on_cpu else dot_precision(x.dtype),
        **pdl_launch(x),
        num_warps=cfg["num_warps"],
    )
    return y


def fp8_skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    impl: str = "auto",
    config: dict | None = None,
) -> torch.Tensor:
    """x (M <= MAX_ROWS, K) times the e4m3 weight (N, K) scaled per row (or x's 16-bit dtype, no scale)
    -> (M, N) in x's dtype (module docstring: the exact math, and what `counters` must be). `config` overrides
    some or all of fp8_skinny_config's tiles (tuned ones: engine.worker.fp8.measured_w8a16_tiles)."""
    _check(x, weight, weight_scale, bias, counters)
    if use_triton(impl, x, "fp8_skinny_linear"):
        return fp8_skinny_linear_triton(x, weight, weight_scale, bias, counters, config)
    return fp8_skinny_linear_ref(x, weight, weight_scale, bias)
