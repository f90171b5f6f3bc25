"""Kernel timings: paged attention against copy bandwidth and torch SDPA, fused ops against their unfused
torch equivalents, and the sweeps behind the decode split-K heuristic.

    python benchmarks/kernel_timings.py --json out/kernels.json                # on a GPU
    TRITON_INTERPRET=1 python benchmarks/kernel_timings.py --smoke             # tiny shapes, CPU
    python benchmarks/kernel_timings.py --sections fp8                         # only the fp8 tables

`--sections fp8`: paged decode attention over a bf16 cache beside the same values in an fp8 (e4m3)
cache (rate against the copy rate for the bytes each reads, replayed from CUDA graphs as the engine runs
decode; the fp8 cache's Triton variants swept beside the engine's choice) (`fp8attn` alone),
and the 8B projections bf16 (cuBLAS) beside fp8 W8A8 (per-token quantization + row-wise
`torch._scaled_mm`) and fp8 W8A16 (splitserve.kernels.fp8_skinny_linear), graphed (`fp8linear` alone; the
code is in fp8_linear.py beside this script).

Times are medians of `triton.testing.do_bench` (CUDA events, L2 flushed between calls, warm-up
first); the fp8 tables' of `do_bench_cudagraph` (replays of a captured graph; each decode call reads
hundreds of MB, far past the L2). Decode bytes count each cached K/V element of the context once (block
tables, q and out are under 0.1% and left out); prefill FLOPs are 4 * Hq * D * L^2 / 2 per causal sequence.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from fp8_linear import bench_fp8_linear, print_fp8_linear

from splitserve.kernels import rms_norm, rotary_embedding, silu_and_mul, write_kv
from splitserve.kernels.paged_decode_attention import paged_decode_attention_triton
from splitserve.kernels.paged_decode_config import choose_num_splits
from splitserve.kernels.paged_prefill_attention import paged_prefill_attention_triton
from splitserve.kernels.rotary import build_cos_sin_cache, rotary_embedding_ref

FULL = dict(
    num_q_heads=32,
    num_kv_heads=8,
    head_dim=128,
    block_size=16,
    num_layers=4,
    tokens=131072,
    decode=[(64, 2048), (256, 512), (4, 32768)],
    prefill=[(1, 8192), (16, 512)],
    split_shapes=[(4, 32768), (16, 8192), (64, 2048), (1, 8192), (256, 512)],
    splits=[1, 2, 4, 8, 16, 32],
    fused_tokens=4096,
    hidden=4096,
    ffn=14336,
)
SMOKE = dict(
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=32,
    block_size=16,
    num_layers=2,
    tokens=256,
    decode=[(2, 64), (1, 128)],
    prefill=[(1, 64), (2, 32)],
    split_shapes=[(1, 128)],
    splits=[1, 2],
    fused_tokens=8,
    hidden=64,
    ffn=64,
)
DECODE_CONFIGS = [
    dict(BLOCK_N=n, num_warps=w, num_stages=s) for n, w, s in [(64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 8, 3)]
]
PREFILL_CONFIGS = [
    dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s, SINGLE_LOOP=one)
    for m, n, w, s, one in [
        (128, 64, 4, 3, False),
        (128, 64, 4, 4, False),
        (128, 64, 4, 2, False),
        (128, 128, 8, 3, False),
        (128, 128, 4, 2, False),
        (64, 64, 4, 3, False),
        (64, 128, 4, 3, False),
        (64, 64, 4, 4, False),
        (64, 32, 4, 3, False),
        (128, 64, 4, 3, True),
        (64, 64, 4, 3, True),
        (64, 64, 4, 4, True),
    ]
]


def time_ms(fn) -> float:
    """Median milliseconds of fn() (CUDA events on GPU; wall clock in the CPU smoke mode)."""
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def time_graph_ms(fn) -> float:
    """Median milliseconds of fn() replayed from a CUDA graph: the device's time, without the host's launch cost
    (the engine replays its decode steps from graphs)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def copy_bandwidth(device, nbytes) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3)


class PagedCache:
    """A block-major cache (num_blocks, num_layers, 2, bs, Hkv, D) of random data; layer 1's views."""

    def __init__(self, p, device, dtype):
        self.num_blocks = p["tokens"] // p["block_size"]
        shape = (self.num_blocks, p["num_layers"], 2, p["block_size"], p["num_kv_heads"], p["head_dim"])
        self.kv = torch.randn(shape, device=device, dtype=dtype)
        self.k_cache, self.v_cache = self.kv[:, 1, 0], self.kv[:, 1, 1]  # (N, bs, Hkv, D) strided
        self.block_size = p["block_size"]

    def tables(self, batch, ctx, gen):
        """Shuffled block tables (B, ctx / bs) int32 over distinct blocks."""
        per_seq = ctx // self.block_size
        ids = torch.randperm(self.num_blocks, generator=gen)[: batch * per_seq]
        return ids.view(batch, per_seq).to(torch.int32).to(self.kv.device)

    def dense(self, table):
        """(B, Hkv, L, D) contiguous copies of the keys and values a table names."""
        batch = table.shape[0]
        k = self.k_cache[table.long()].reshape(batch, -1, *self.k_cache.shape[2:])  # (B, L, Hkv, D)
        v = self.v_cache[table.long()].reshape(batch, -1, *self.v_cache.shape[2:])
        return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def bench_decode(p, cache, copy_bw, device, dtype, gen):
    rows, scale = [], p["head_dim"] ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4
    for batch, ctx in p["decode"]:
        table = cache.tables(batch, ctx, gen)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(batch, p["num_q_heads"], p["head_dim"], device=device, dtype=dtype)
        splits = choose_num_splits(batch, p["num_kv_heads"], table.shape[1] * p["block_size"], sms)
        run = lambda: paged_decode_attention_triton(q, cache.k_cache, cache.v_cache, table, seq_lens, scale)  # noqa: E731
        out = run()
        k, v = cache.dense(table)
        qd = q.unsqueeze(2)  # (B, Hq, 1, D)
        sdpa = lambda: F.scaled_dot_product_attention(qd, k, v, scale=scale, enable_gqa=True)  # noqa: E731, F821
        err = (out.float() - sdpa().squeeze(2).float()).abs().max().item()
        t, t_sdpa = time_ms(run), time_ms(sdpa)
        nbytes = 2 * batch * ctx * p["num_kv_heads"] * p["head_dim"] * cache.kv.element_size()
        rows.append(
            dict(
                batch=batch,
                ctx=ctx,
                num_splits=splits,
                ms=t,
                sdpa_ms=t_sdpa,
                bytes=nbytes,
                gbps=nbytes / t / 1e6,
                sdpa_gbps=nbytes / t_sdpa / 1e6,
                pct_copy=100 * nbytes / (t * 1e-3) / copy_bw,
                pct_sdpa=100 * t_sdpa / t,
                max_abs_err=err,
            )
        )
        del k, v
    return rows


def sweep_decode(p, cache, device, dtype, gen):
    """Time per split count per shape (default config), and per config at two shapes."""
    scale, split_rows, config_rows = p["head_dim"] ** -0.5, [], []
    for batch, ctx in p["split_shapes"]:
        table = cache.tables(batch, ctx, gen)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(batch, p["num_q_heads"], p["head_dim"], device=device, dtype=dtype)
        times = {
            s: time_ms(
                lambda s=s: paged_decode_attention_triton(
                    q, cache.k_cache, cache.v_cache, table, seq_lens, scale, num_splits=s
                )
            )
            for s in p["splits"]
        }
        split_rows.append(dict(batch=batch, ctx=ctx, ms_by_splits=times, best=min(times, key=times.get)))
        if (batch, ctx) in p["decode"][:1] + p["decode"][-1:]:
            for cfg in DECODE_CONFIGS if device == "cuda" else DECODE_CONFIGS[:1]:
                for s in sorted({1, min(times, key=times.get)}):
                    ms = time_ms(
                        lambda: paged_decode_attention_triton(
                            q, cache.k_cache, cache.v_cache, table, seq_lens, scale, num_splits=s, config=cfg
                        )
                    )
                    config_rows.append(dict(batch=batch, ctx=ctx, num_splits=s, **cfg, ms=ms))
    return split_rows, config_rows


def bench_prefill(p, cache, device, dtype, gen):
    rows, config_rows, scale = [], [], p["head_dim"] ** -0.5
    hq, d = p["num_q_heads"], p["head_dim"]
    for batch, length in p["prefill"]:
        table = cache.tables(batch, length, gen)
        seq_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
        qsl = (torch.arange(batch + 1, dtype=torch.int32) * length).to(device)
        q = torch.randn(batch * length, hq, d, device=device, dtype=dtype)  # (T, Hq, D)
        run = lambda cfg=None: paged_prefill_attention_triton(  # noqa: E731
            q, cache.k_cache, cache.v_cache, table, qsl, seq_lens, length, scale, config=cfg
        )
        out = run()
        k, v = cache.dense(table)
        qd = q.view(batch, length, hq, d).transpose(1, 2)  # (B, Hq, L, D)
        sdpa = lambda: F.scaled_dot_product_attention(qd, k, v, scale=scale, is_causal=True, enable_gqa=True)  # noqa: E731, F821
        ref = sdpa().transpose(1, 2).reshape(batch * length, hq, d)
        err = (out.float() - ref.float()).abs().max().item()
        flops = 4 * batch * hq * d * length * length / 2
        t, t_sdpa = time_ms(run), time_ms(sdpa)
        rows.append(
            dict(
                batch=batch,
                length=length,
                ms=t,
                sdpa_ms=t_sdpa,
                tflops=flops / t / 1e9,
                sdpa_tflops=flops / t_sdpa / 1e9,
                pct_sdpa=100 * t_sdpa / t,
                max_abs_err=err,
            )
        )
        for cfg in PREFILL_CONFIGS if device == "cuda" else PREFILL_CONFIGS[-1:]:
            try:  # a config may not fit the chip (shared memory, registers): record and go on
                ms = time_ms(lambda: run(cfg))
            except Exception as exc:  # noqa: BLE001
                print(f"prefill config {cfg} failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            config_rows.append(dict(batch=batch, length=length, **cfg, ms=ms, tflops=flops / ms / 1e9))
        del k, v
    return rows, config_rows


def bench_fused(p, device, dtype):
    """Fused Triton ops against the unfused torch code they replace; GB/s on the fused op's bytes."""
    t_tok, hidden, ffn = p["fused_tokens"], p["hidden"], p["ffn"]
    hq, hkv, d = p["num_q_heads"], p["num_kv_heads"], p["head_dim"]
    x = torch.randn(t_tok, hidden, device=device, dtype=dtype)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device=device, dtype=dtype)
    gate_up = torch.randn(t_tok, 2 * ffn, device=device, dtype=dtype)
    q = torch.randn(t_tok, hq, d, device=device, dtype=dtype)
    k = torch.randn(t_tok, hkv, d, device=device, dtype=dtype)
    pos = torch.randint(0, 8192, (t_tok,), device=device)
    cos_sin = build_cos_sin_cache(d, 8192, 500000.0, None, dtype, device=device)
    kc = torch.zeros(t_tok // 16 + 1, 16, hkv, d, device=device, dtype=dtype)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(t_tok, device=device)
    el = x.element_size()
    cases = [
        (
            "rms_norm+residual",
            lambda: rms_norm(x, w, 1e-6, residual=res, impl="triton"),
            lambda: rms_norm(x, w, 1e-6, residual=res, impl="ref"),
            5 * x.numel() * el,
        ),
        (
            "rms_norm",
            lambda: rms_norm(x, w, 1e-6, impl="triton"),
            lambda: rms_norm(x, w, 1e-6, impl="ref"),
            2 * x.numel() * el,
        ),
        (
            "silu_and_mul",
            lambda: silu_and_mul(gate_up, impl="triton"),
            lambda: silu_and_mul(gate_up, impl="ref"),
            3 * gate_up.numel() // 2 * el,
        ),
        (
            "rotary",
            lambda: rotary_embedding(pos, q, k, cos_sin, impl="triton"),
            lambda: rotary_embedding_ref(pos, q, k, cos_sin),
            2 * (q.numel() + k.numel()) * el,
        ),
        (
            "write_kv",
            lambda: write_kv(k, k, kc, vc, slots, impl="triton"),
            lambda: write_kv(k, k, kc, vc, slots, impl="ref"),
            4 * k.numel() * el,
        ),
    ]
    rows = []
    for name, fused, unfused, nbytes in cases:
        t_f, t_u = time_ms(fused), time_ms(unfused)
        rows.append(
            dict(
                op=name,
                tokens=t_tok,
                ms=t_f,
                torch_ms=t_u,
                gbps=nbytes / t_f / 1e6,
                torch_gbps=nbytes / t_u / 1e6,
                speedup=t_u / t_f,
            )
        )
    return rows


# fp8 decode tiles tried: DOT_F16 (upcast to f16, q too) or the upcast to q's bf16; tile width, warps, stages
FP8_CONFIGS = [dict(DOT_F16=False, BLOCK_N=64, num_warps=4, num_stages=2)] + [
    dict(DOT_F16=True, BLOCK_N=n, num_warps=w, num_stages=st)
    for n, w, st in ((64, 4, 2), (64, 4, 1), (64, 4, 3), (32, 4, 2), (128, 4, 2), (128, 8, 2))
]


def bench_fp8_decode(p, copy_bw, device, gen):
    """Decode attention over a bf16 cache and the same values in e4m3, side by side, + a tile sweep of the fp8
    cache's Triton variants beside the engine's own choice (on an H200 the mma kernel). On a GPU every time is
    replayed from a CUDA graph, as the engine runs its decode steps (launched one by one, the fp8 calls took
    ~10 us more each on an H200: docs/performance.md, "Findings that set defaults")."""
    fp8 = torch.float8_e4m3fn
    timer = time_graph_ms if device == "cuda" else time_ms
    cache = PagedCache(p, device, torch.bfloat16)
    kv8 = cache.kv.to(fp8)
    k8, v8 = kv8[:, 1, 0], kv8[:, 1, 1]
    kv_up = kv8.to(torch.bfloat16)  # the fp8 values in bf16: the reference the fp8 kernel must match
    ku, vu = kv_up[:, 1, 0], kv_up[:, 1, 1]
    rows, sweep, scale = [], [], p["head_dim"] ** -0.5
    for batch, ctx in p["decode"]:
        table = cache.tables(batch, ctx, gen)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(batch, p["num_q_heads"], p["head_dim"], device=device, dtype=torch.bfloat16)
        elems = 2 * batch * ctx * p["num_kv_heads"] * p["head_dim"]
        row = dict(batch=batch, ctx=ctx)
        for name, (kc, vc), nbytes in (("bf16", (cache.k_cache, cache.v_cache), 2 * elems), ("fp8", (k8, v8), elems)):
            run = lambda kc=kc, vc=vc: paged_decode_attention_triton(q, kc, vc, table, seq_lens, scale)  # noqa: E731
            t = timer(run)
            row[f"{name}_ms"], row[f"{name}_pct_copy"] = t, 100 * nbytes / (t * 1e-3) / copy_bw
        ref = paged_decode_attention_triton(q, ku, vu, table, seq_lens, scale)
        row["fp8_max_abs_err"] = (
            (paged_decode_attention_triton(q, k8, v8, table, seq_lens, scale) - ref).abs().max().item()
        )
        best = (row["fp8_ms"], "engine's choice")
        for cfg in FP8_CONFIGS if device == "cuda" else FP8_CONFIGS[:1]:
            t = timer(lambda cfg=cfg: paged_decode_attention_triton(q, k8, v8, table, seq_lens, scale, config=cfg))
            tile = fp8_tile_name(cfg)
            sweep.append(dict(batch=batch, ctx=ctx, tile=tile, ms=t))
            best = min(best, (t, tile), key=lambda x: x[0])
        row["fp8_best_ms"], row["fp8_best_tile"] = best
        row["fp8_best_pct_copy"] = 100 * elems / (best[0] * 1e-3) / copy_bw
        rows.append(row)
    del cache, kv8, kv_up
    print("fp8 decode, the Triton variants' tiles (ms):")
    for x in sweep:
        print(f"  ({x['batch']}, {x['ctx']}) {x['tile']}: {x['ms']:.4f}")
    return rows, sweep


def fp8_tile_name(cfg: dict) -> str:
    return f"{'f16' if cfg['DOT_F16'] else 'bf16'} N{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"


def print_fp8_tables(r) -> None:
    print(f"\ncopy bandwidth: {r['copy_gbps']:.0f} GB/s (read + write)")
    if "fp8_decode" in r:
        print(
            "\n| decode (B, ctx) | bf16 ms | bf16 % copy | fp8 ms (engine's choice) | fp8 % copy | fp8 best ms "
            "| best % copy | best | fp8 err |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for x in r["fp8_decode"]:
            print(
                f"| ({x['batch']}, {x['ctx']}) | {x['bf16_ms']:.4f} | {x['bf16_pct_copy']:.1f} | {x['fp8_ms']:.4f} | "
                f"{x['fp8_pct_copy']:.1f} | {x['fp8_best_ms']:.4f} | {x['fp8_best_pct_copy']:.1f} | "
                f"{x['fp8_best_tile']} | {x['fp8_max_abs_err']:.1e} |"
            )
    if "fp8_linear" in r:
        print_fp8_linear(r["fp8_linear"])


def print_tables(r) -> None:
    print(f"\ncopy bandwidth: {r['copy_gbps']:.0f} GB/s (read + write)")
    print("\n| decode (B, ctx) | splits | ms | GB/s | % copy | SDPA ms | SDPA GB/s | % of SDPA rate | max err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for x in r["decode"]:
        print(
            f"| ({x['batch']}, {x['ctx']}) | {x['num_splits']} | {x['ms']:.4f} | {x['gbps']:.0f} | "
            f"{x['pct_copy']:.1f} | {x['sdpa_ms']:.4f} | {x['sdpa_gbps']:.0f} | {x['pct_sdpa']:.1f} | "
            f"{x['max_abs_err']:.2e} |"
        )
    print("\n| prefill (B x L) | ms | TFLOP/s | SDPA ms | SDPA TFLOP/s | % of SDPA | max err |")
    print("|---|---|---|---|---|---|---|")
    for x in r["prefill"]:
        print(
            f"| {x['batch']} x {x['length']} | {x['ms']:.3f} | {x['tflops']:.0f} | {x['sdpa_ms']:.3f} | "
            f"{x['sdpa_tflops']:.0f} | {x['pct_sdpa']:.1f} | {x['max_abs_err']:.2e} |"
        )
    print("\n| fused op | tokens | ms | GB/s | torch ms | torch GB/s | speedup |")
    print("|---|---|---|---|---|---|---|")
    for x in r["fused"]:
        print(
            f"| {x['op']} | {x['tokens']} | {x['ms']:.4f} | {x['gbps']:.0f} | {x['torch_ms']:.4f} | "
            f"{x['torch_gbps']:.0f} | {x['speedup']:.2f}x |"
        )
    print("\nsplit sweep (ms by num_splits):")
    for x in r["split_sweep"]:
        print(
            f"  ({x['batch']}, {x['ctx']}): "
            + ", ".join(f"{s}: {ms:.4f}" for s, ms in x["ms_by_splits"].items())
            + f"  best {x['best']}"
        )
    print("decode configs:")
    for x in r["decode_configs"]:
        print(
            f"  ({x['batch']}, {x['ctx']}) splits {x['num_splits']} N{x['BLOCK_N']} w{x['num_warps']} "
            f"s{x['num_stages']}: {x['ms']:.4f} ms"
        )
    print("prefill configs:")
    for x in r["prefill_configs"]:
        print(
            f"  {x['batch']} x {x['length']} M{x['BLOCK_M']} N{x['BLOCK_N']} w{x['num_warps']} "
            f"s{x['num_stages']}{' single-loop' if x['SINGLE_LOOP'] else ''}: {x['ms']:.3f} ms "
            f"{x['tflops']:.0f} TFLOP/s"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write all results here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    parser.add_argument(
        "--sections",
        default="all",
        choices=("all", "fp8", "fp8attn", "fp8linear"),
        help="fp8: only the fp8 tables (fp8attn: decode attention, fp8linear: the projections)",
    )
    args = parser.parse_args(argv)
    p = SMOKE if args.smoke else FULL
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    r = dict(
        device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        torch=torch.__version__,
        dtype=str(dtype),
        params={k: v for k, v in p.items()},
    )
    import triton

    r["triton"] = triton.__version__
    r["copy_gbps"] = copy_bandwidth(device, (2 << 30) if device == "cuda" else (1 << 20)) / 1e9
    if args.sections.startswith("fp8"):
        if args.sections in ("fp8", "fp8attn"):
            r["fp8_decode"], r["fp8_decode_sweep"] = bench_fp8_decode(p, r["copy_gbps"] * 1e9, device, gen)
        if args.sections in ("fp8", "fp8linear"):
            r["fp8_linear"] = bench_fp8_linear(device, r["copy_gbps"] * 1e9, smoke=args.smoke)
        print_fp8_tables(r)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=1, default=str)
        return 0
    cache = PagedCache(p, device, dtype)
    r["decode"] = bench_decode(p, cache, r["copy_gbps"] * 1e9, device, dtype, gen)
    r["prefill"], r["prefill_configs"] = bench_prefill(p, cache, device, dtype, gen)
    r["split_sweep"], r["decode_configs"] = sweep_decode(p, cache, device, dtype, gen)
    del cache
    r["fused"] = bench_fused(p, device, dtype)
    print_tables(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
