"""Llama-3-8B's projections three ways, side by side: bf16 (cuBLAS), fp8 W8A8 (per-token quantizer +
row-wise `torch._scaled_mm`, what Fp8Linear runs on a GPU above 16 rows) and fp8 W8A16
(`splitserve.kernels.fp8_skinny_linear`, what it runs up to there), at 1 and 16 rows, W8A8 and bf16 at 128
rows, plus a tile sweep of the W8A16 kernel, and at one row the same kernel over the bf16 weight (the plain
GEMV that splitserve.engine.worker.fused_ops puts in place of cuBLAS where a tuned table says so) with its own
sweep. A module, not a script: run it through kernel_timings.py (`python benchmarks/kernel_timings.py
--sections fp8linear` or `fp8`).

Times are what a decode graph pays: each variant is captured back to back in one CUDA graph over enough
weight copies that the graph's working set is 3x the L2 (each call reads its weight from HBM), replayed,
and divided by the calls (eager do_bench timings of these ~20 us kernels include the host's launch).
`% copy` = the bytes the call reads (weight + x) per second against the copy rate. `rel err` = |y - y32| /
|y32| against the fp32 product of the bf16 weight; `kernel ok` = the kernel within one bf16 step of its
fp32 reference on the same e4m3 operands (tests/kernels/test_fp8_skinny_linear.py's tolerance).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

# (name, N, K) of Llama-3-8B's projections; a decode step runs each once per layer (32 layers)
FP8_LINEARS = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
FP8_LINEARS_SMOKE = [("qkv", 48, 64), ("down", 40, 100)]
L2_BYTES = 50 << 20  # H200
# W8A16 tiles swept (the first of each list is the kernel's default); SPLIT_K "auto" = split_k_for
GEMV_SWEEP = [
    dict(DOT=False, BLOCK_N=16, BLOCK_K=512, num_warps=4, num_stages=3),
    dict(DOT=False, BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4),
    dict(DOT=False, BLOCK_N=16, BLOCK_K=512, num_warps=4, num_stages=1),
    dict(DOT=False, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3),
    dict(DOT=False, BLOCK_N=32, BLOCK_K=512, num_warps=8, num_stages=2),
    dict(DOT=False, BLOCK_N=16, BLOCK_K=1024, num_warps=8, num_stages=2),
    dict(DOT=True, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4),
]
DOT_SWEEP = [
    dict(DOT=True, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4),
    dict(DOT=True, BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4),
    dict(DOT=True, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(DOT=True, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(DOT=True, BLOCK_N=64, BLOCK_K=256, num_warps=8, num_stages=3),
    dict(DOT=True, BLOCK_N=32, BLOCK_K=512, num_warps=4, num_stages=3),
]
SPLIT_FACTORS = (0, 2)  # the default tile with SPLIT_K = 1 and twice split_k_for's; "auto" is always run


def graph_ms(fns: list, device: str, reps: int = 15) -> float:
    """Mean ms per call of `fns` (zero-argument launches) captured back to back in one CUDA graph and
    replayed; on CPU (the smoke mode) the wall clock of one pass."""
    if device != "cuda":
        start = time.perf_counter()
        for fn in fns:
            fn()
        return 1e3 * (time.perf_counter() - start) / len(fns)
    loops = max(1, 48 // len(fns))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(loops):
            for fn in fns:
                fn()
    graph.replay()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / (loops * len(fns)))
    del graph
    return statistics.median(samples)


class Projection:
    """`copies` independent random bf16 weights (N, K): kept as they are (`weights`), or quantized to
    Fp8Linear layers (`fp8`, each W8A8 at every M: the W8A16 kernel is called directly) with the first
    bf16 weight kept as the reference."""

    def __init__(self, n: int, k: int, device: str, copies: int, gen: torch.Generator, quantize: bool):
        from splitserve.engine.worker.fp8 import Fp8Linear

        self.n, self.k = n, k
        self.weights, self.fp8 = [], []
        for i in range(copies):
            weight = (torch.randn(n, k, generator=gen) * 0.02).to(device, torch.bfloat16)
            if not quantize or i == 0:
                self.weights.append(weight)
            if quantize:
                lin = torch.nn.Module()
                lin.weight, lin.bias, lin.output_sizes = weight, None, (n,)
                self.fp8.append(Fp8Linear.from_linear(lin))  # fp8_w8a16_max_rows 0: W8A8 at every M

    def counters(self, device: str) -> torch.Tensor:
        """Zeroed split-K counters for one weight copy (splitserve.kernels.fp8_skinny_linear)."""
        return torch.zeros(-(-self.n // 16), dtype=torch.int32, device=device)


def copies_for(weight_bytes: int, device: str) -> int:
    """Weight copies so that a pass over them reads 3x the L2 (2 at least; 1 in the smoke mode)."""
    return max(2, -(-3 * L2_BYTES // weight_bytes)) if device == "cuda" else 1


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def w8a16_configs(m: int, n: int, k: int, sms: int, on_cpu: bool) -> list[dict]:
    """The W8A16 configs timed for M rows of an (N, K) weight, each once: the kernel's default first, then
    the sweep's (M = 1: GEMV_SWEEP, else DOT_SWEEP, FMA tiles dropped) with split_k_for's SPLIT_K, then the
    default's split variants (all compile cleanly for sm_90: docs/performance.md, "Answered questions")."""
    from splitserve.kernels.fp8_skinny_linear import fp8_skinny_config, split_k_for

    default = fp8_skinny_config(m, n, k, sms, on_cpu)
    sweep = GEMV_SWEEP if m == 1 else DOT_SWEEP
    configs = [default] + [dict(c, SPLIT_K=split_k_for(n, k, c["BLOCK_N"], c["BLOCK_K"], sms)) for c in sweep]
    configs += [dict(default, SPLIT_K=max(1, f * default["SPLIT_K"])) for f in SPLIT_FACTORS]
    unique = []
    for cfg in configs:
        if (cfg["DOT"] or m == 1) and cfg not in unique:  # FMA tiles take one row
            unique.append(cfg)
    return unique


def _time_tiles(configs: list[dict], weights: list, scales: list, x, xs, counters: list, device: str):
    """Each config checked once on x against the first weight (within the kernel's error bound) and timed over
    every weight copy (`scales` None for 16-bit weights). Returns the timed configs (+ ms, ok), the fastest
    correct one (the first if none is), and the first config's output."""
    from splitserve.kernels.fp8_skinny_linear import (
        fp8_skinny_linear_error_bound,
        fp8_skinny_linear_ref,
        fp8_skinny_linear_triton,
    )

    want = fp8_skinny_linear_ref(x, weights[0], scales[0]).float()
    bound = fp8_skinny_linear_error_bound(x, weights[0], scales[0]).float()
    timed, first = [], None
    for cfg in configs:
        got = fp8_skinny_linear_triton(x, weights[0], scales[0], counters=counters[0], config=cfg)
        first = got if first is None else first
        ok = bool(((got.float() - want).abs() <= bound).all())
        calls = [
            lambda i=i: fp8_skinny_linear_triton(xs[i], weights[i], scales[i], counters=counters[i], config=cfg)
            for i in range(len(weights))
        ]
        timed.append(dict(cfg, ms=graph_ms(calls, device), ok=ok))
    best = min((t for t in timed if t["ok"]), key=lambda t: t["ms"], default=timed[0])
    return timed, best, first


def _w8a16_rows(proj: Projection, x, xs, device: str) -> dict:
    """The W8A16 kernel's default tiles, then each swept config (its SPLIT_K from split_k_for) and split
    variants of the default; each checked against the reference once, the best taken among those correct."""
    from splitserve.kernels._common import num_sms

    m, n, k = x.shape[0], proj.n, proj.k
    configs = w8a16_configs(m, n, k, num_sms(0) if device == "cuda" else 1, device != "cuda")
    weights, scales = [lay.weight for lay in proj.fp8], [lay.weight_scale for lay in proj.fp8]
    counters = [proj.counters(device) for _ in proj.fp8]
    timed, best, got = _time_tiles(configs, weights, scales, x, xs, counters, device)
    return dict(
        w8a16_ms=timed[0]["ms"],
        w8a16_config=configs[0],
        w8a16_best_ms=best["ms"],
        w8a16_best_config=best,
        w8a16_ok=all(t["ok"] for t in timed),
        w8a16_rel_err=_rel_err(got, F.linear(x.float(), proj.weights[0].float())),
        w8a16_sweep=timed,
    )


def _gemv16_rows(proj: Projection, x, xs, device: str) -> dict:
    """The kernel over the bf16 weights at one row (no scale): its default tiles, GEMV_SWEEP's tiles at half the
    BLOCK_K (the same bytes a step), split variants of the default; each checked against the bound once."""
    from splitserve.kernels._common import num_sms
    from splitserve.kernels.fp8_skinny_linear import fp8_skinny_config, split_k_for

    n, k = proj.n, proj.k
    sms = num_sms(0) if device == "cuda" else 1
    default = fp8_skinny_config(1, n, k, sms, device != "cuda", torch.bfloat16, weight_bytes=2)
    configs = [default]
    for c in GEMV_SWEEP:
        if not c["DOT"]:
            half = dict(c, BLOCK_K=max(32, c["BLOCK_K"] // 2))
            configs.append(dict(half, SPLIT_K=split_k_for(n, k, half["BLOCK_N"], half["BLOCK_K"], sms)))
    configs += [dict(default, SPLIT_K=max(1, f * default["SPLIT_K"])) for f in (0, 2, 4)]
    configs = [c for i, c in enumerate(configs) if c not in configs[:i]]
    counters = [proj.counters(device) for _ in proj.weights]
    timed, best, _ = _time_tiles(configs, proj.weights, [None] * len(proj.weights), x, xs, counters, device)
    return dict(
        gemv_ms=timed[0]["ms"],
        gemv_best_ms=best["ms"],
        gemv_best_config=best,
        gemv_ok=all(t["ok"] for t in timed),
        gemv_sweep=timed,
    )


def bench_fp8_linear(device: str, copy_bw: float, smoke: bool = False) -> list[dict]:
    """Rows per (projection, M): bf16, W8A8 (quantizer alone too) and, for M <= 16, W8A16 with its sweep."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, n, k in FP8_LINEARS_SMOKE if smoke else FP8_LINEARS:
        bf16 = Projection(n, k, device, copies_for(2 * n * k, device), gen, quantize=False)
        fp8 = Projection(n, k, device, copies_for(n * k, device), gen, quantize=True)
        for m in (1, 16, 128):
            num_x = max(len(bf16.weights), len(fp8.fp8))
            xs = [torch.randn(m, k, generator=gen).to(device, torch.bfloat16) for _ in range(num_x)]
            x = xs[0]
            row = dict(op=name, n=n, k=k, m=m)
            row["bf16_ms"] = graph_ms([lambda i=i, w=w: F.linear(xs[i], w) for i, w in enumerate(bf16.weights)], device)
            row["w8a8_ms"] = graph_ms([lambda i=i, lay=lay: lay(xs[i]) for i, lay in enumerate(fp8.fp8)], device)
            quant = [lambda i=i, lay=lay: lay.quantize_input(xs[i]) for i, lay in enumerate(fp8.fp8)]
            row["quant_ms"] = graph_ms(quant, device)
            row["w8a8_rel_err"] = _rel_err(fp8.fp8[0](x), F.linear(x.float(), fp8.weights[0].float()))
            row["scaled_mm"] = fp8.fp8[0].use_scaled_mm
            if m <= 16:
                row.update(_w8a16_rows(fp8, x, xs, device))
            if m == 1:
                row.update(_gemv16_rows(bf16, x, xs, device))
            for key in ("bf16", "w8a8", "w8a16", "w8a16_best", "gemv", "gemv_best"):
                if f"{key}_ms" in row:
                    read = (2 if key in ("bf16", "gemv", "gemv_best") else 1) * n * k + 2 * m * k
                    row[f"{key}_pct_copy"] = 100 * read / (row[f"{key}_ms"] * 1e-3) / copy_bw
            rows.append(row)
            print({key: v for key, v in row.items() if not key.endswith("_sweep")}, flush=True)
        del bf16, fp8
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def swept_tiles(kernels_json: str) -> dict[tuple[str, int, int], dict]:
    """A table for splitserve.engine.worker.fp8.W8A16_TILES from a kernel_timings.py JSON (`--sections fp8linear`):
    each projection's best correct W8A16 tiles, M = 1 as "gemv", M = 16 as "dot" (used for 2-16 rows). The
    shipped tables are data files under kernels/splitserve/kernels/configs/ (splitserve.kernels.tuned_configs)."""
    import json
    from pathlib import Path

    rows = json.loads(Path(kernels_json).read_text()).get("fp8_linear") or []
    tiles = {}
    for r in rows:
        if "w8a16_best_config" in r and r["w8a16_ok"]:
            config = {key: v for key, v in r["w8a16_best_config"].items() if key not in ("ms", "ok")}
            tiles[("gemv" if r["m"] == 1 else "dot", r["n"], r["k"])] = config
    return tiles


def gemv_tiles(kernels_json: str) -> dict[tuple[int, int], dict]:
    """A table for splitserve.engine.worker.fused_ops.GEMV_TILES from a kernel_timings.py JSON (`--sections
    fp8linear`): the bf16 GEMV's best correct tiles for each projection where they beat cuBLAS at one row."""
    import json
    from pathlib import Path

    rows = json.loads(Path(kernels_json).read_text()).get("fp8_linear") or []
    return {
        (r["n"], r["k"]): {key: v for key, v in r["gemv_best_config"].items() if key not in ("ms", "ok")}
        for r in rows
        if r["m"] == 1 and "gemv_best_config" in r and r["gemv_best_config"]["ok"] and r["gemv_best_ms"] < r["bf16_ms"]
    }


def _tile(c: dict) -> str:
    kind = "dot" if c["DOT"] else "fma"
    return f"{kind} N{c['BLOCK_N']} K{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']} split{c['SPLIT_K']}"


def print_fp8_linear(rows: list[dict]) -> None:
    """The sweep, then the side-by-side table (last)."""
    print("\nW8A16 tile sweep (ms per call, graphed):")
    for r in rows:
        for s in r.get("w8a16_sweep", []):
            print(f"  {r['op']} M={r['m']} {_tile(s)}: {s['ms']:.4f}{'' if s['ok'] else ' WRONG'}")
    print("\nbf16 GEMV tile sweep (ms per call, graphed):")
    for r in rows:
        for s in r.get("gemv_sweep", []):
            print(f"  {r['op']} {_tile(s)}: {s['ms']:.4f}{'' if s['ok'] else ' WRONG'}")
    print()
    print("\n".join(fp8_linear_table(rows)))


def fp8_linear_table(rows: list[dict]) -> list[str]:
    """The projections table's lines (markdown)."""
    lines = [
        "| projection (8B) | M | bf16 cuBLAS ms (% copy) | W8A8 quant + _scaled_mm ms (% copy) | of which quant ms "
        "| W8A16 kernel ms (% copy) | W8A16 best ms (% copy) | best tiles | W8A16 / bf16 | rel err W8A8 / W8A16 "
        "| kernel ok (all tiles) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        w16 = best = tiles = ratio = ok = "-"
        err16 = ""
        if "w8a16_ms" in r:
            w16 = f"{r['w8a16_ms']:.4f} ({r['w8a16_pct_copy']:.0f})"
            best = f"{r['w8a16_best_ms']:.4f} ({r['w8a16_best_pct_copy']:.0f})"
            tiles, ratio = _tile(r["w8a16_best_config"]), f"{r['w8a16_ms'] / r['bf16_ms']:.2f}"
            err16, ok = f" / {r['w8a16_rel_err']:.4f}", "yes" if r["w8a16_ok"] else "**NO**"
        lines.append(
            f"| {r['op']} {r['n']}x{r['k']} | {r['m']} | {r['bf16_ms']:.4f} ({r['bf16_pct_copy']:.0f}) | "
            f"{r['w8a8_ms']:.4f} ({r['w8a8_pct_copy']:.0f}) | {r['quant_ms']:.4f} | {w16} | {best} | {tiles} | "
            f"{ratio} | {r['w8a8_rel_err']:.4f}{err16} | {ok} |"
        )
    gemv = [r for r in rows if "gemv_ms" in r]
    if gemv:
        lines += [
            "",
            "| projection (8B), one row | bf16 cuBLAS ms (% copy) | bf16 GEMV kernel ms (% copy) | GEMV best ms "
            "(% copy) | best tiles | best / cuBLAS | kernel ok (all tiles) |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in gemv:
            lines.append(
                f"| {r['op']} {r['n']}x{r['k']} | {r['bf16_ms']:.4f} ({r['bf16_pct_copy']:.0f}) | "
                f"{r['gemv_ms']:.4f} ({r['gemv_pct_copy']:.0f}) | {r['gemv_best_ms']:.4f} "
                f"({r['gemv_best_pct_copy']:.0f}) | {_tile(r['gemv_best_config'])} | "
                f"{r['gemv_best_ms'] / r['bf16_ms']:.2f} | {'yes' if r['gemv_ok'] else '**NO**'} |"
            )
    for m in sorted({r["m"] for r in rows}):  # what a decode step of M rows spends in its projections
        at_m = [r for r in rows if r["m"] == m]
        keys = [key for key in ("bf16", "w8a8", "w8a16", "w8a16_best", "gemv", "gemv_best") if f"{key}_ms" in at_m[0]]
        sums = ", ".join(f"{key} {32 * sum(r[f'{key}_ms'] for r in at_m):.3f}" for key in keys)
        if "gemv_best_ms" in at_m[0]:
            sums += f", bf16 or GEMV (the faster) {32 * sum(min(r['bf16_ms'], r['gemv_best_ms']) for r in at_m):.3f}"
        lines.append(f"\nM={m}, the four projections x 32 layers, ms: {sums}")
    return lines
