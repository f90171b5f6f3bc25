"""Issue 19: the 8B down projection (N 4096, K 14336, e4m3 weight) with the SiLU-mul fused into
kernels.fp8_skinny_linear's loads (`silu=True`, what Fp8Linear.forward_silu runs) against the two launches it
replaces (kernels.silu_and_mul, then the kernel on its output), at M = 1 and 16 rows.

    python3 -m bench.silu_gemv_gpu --json $OUT/silu_gemv.json [--fp8-tiles KERNELS_JSON]
        [--tiles '{"BLOCK_N":16,...}'] [--dot-tiles '{...}'] [--sweep]
    TRITON_INTERPRET=1 python3 -m bench.silu_gemv_gpu --smoke       # tiny shapes on CPU (the script's own check)

Tiles: the kernel's own (fp8_skinny_config), what the engine runs with W8A16_TILES empty; --fp8-tiles takes a
bench/kernels.py --sections fp8linear JSON (bench.fp8_linear.swept_tiles: "gemv" for M = 1, "dot" for M = 16,
as bench/offline_throughput's splitserve:fp8swept); --tiles (M = 1) and --dot-tiles (M = 16) override keys of
either. --sweep also times bench.fp8_linear.w8a16_configs' tiles both ways.

Each variant is checked first: the fused output must equal silu_and_mul + the unfused kernel bit for bit on
every weight copy (and lie within the kernel's error bound of its reference); a mismatch exits 1 after the
table. Times: bench.fp8_linear.graph_ms, each variant captured back to back in one CUDA graph over weight copies
3x the L2, ms per call; `silu` and `gemv` are the unfused pair's two launches timed alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from bench.fp8_linear import copies_for, graph_ms, swept_tiles, w8a16_configs

LAYERS = 32  # Llama-3-8B: one down projection per layer and decode step
# Tiles for --sweep beside bench.fp8_linear's, for the SiLU's cost: in the tensor-core loop every warp makes the
# activation of all 16 rows x BLOCK_K (the dot operand is replicated across warps), so its share of a weight KiB
# goes as 16 warps / BLOCK_N: wide N tiles with few warps; the GEMV's as 1 / BLOCK_N (bench/fp8_linear_sass.py,
# Triton 3.6 sm_90: 16 x 512 fused 238 warp SASS a KiB against 118 unfused, 64 x 128 128; tensor cores 32 x 256
# 1,064 against 145, 128 x 64 341)
SILU_SWEEP = {
    1: [
        dict(DOT=False, BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=1),
        dict(DOT=False, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
    ],
    16: [
        dict(DOT=True, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
        dict(DOT=True, BLOCK_N=256, BLOCK_K=64, num_warps=4, num_stages=3),
        dict(DOT=True, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
    ],
}


def _weights(n: int, k: int, copies: int, device: str):
    """`copies` random e4m3 weights (N, K), their row scales (N,) fp32 and split-K counters."""
    from splitserve.engine.quant import quantize_per_channel

    gen = torch.Generator().manual_seed(0)
    weights, scales, counters = [], [], []
    for _ in range(copies):
        w_q, scale = quantize_per_channel((torch.randn(n, k, generator=gen) * 0.02).to(device))
        weights.append(w_q)
        scales.append(scale)
        counters.append(torch.zeros(-(-n // 16), dtype=torch.int32, device=device))
    return weights, scales, counters


def _gate_ups(rows: int, k: int, copies: int, device: str) -> list[torch.Tensor]:
    """A bf16 [gate | up] (rows, 2K) for each weight copy."""
    gen = torch.Generator().manual_seed(rows)
    return [(2 * torch.randn(rows, 2 * k, generator=gen)).to(device, torch.bfloat16) for _ in range(copies)]


def _check(ops, cfg: dict) -> dict:
    """Fused against silu_and_mul + the unfused kernel on every copy: bit-exact, and within the error bound."""
    from splitserve.kernels.activation import silu_and_mul
    from splitserve.kernels.fp8_skinny_linear import (
        fp8_skinny_linear_error_bound,
        fp8_skinny_linear_ref,
        fp8_skinny_linear_triton,
    )

    exact = within = True
    mismatched = 0
    for w, s, c, gu in zip(*ops):
        act = silu_and_mul(gu, impl="triton")
        want = fp8_skinny_linear_triton(act, w, s, counters=c, config=cfg)
        got = fp8_skinny_linear_triton(gu, w, s, counters=c, config=cfg, silu=True)
        exact &= torch.equal(got, want)
        mismatched += int((got != want).sum())
        bound = fp8_skinny_linear_error_bound(act, w, s).float()
        ref = fp8_skinny_linear_ref(act, w, s).float()
        within &= bool(((got.float() - ref).abs() <= bound).all())
    return dict(exact=exact, mismatched=mismatched, within_bound=within)


def _time(ops, cfg: dict, device: str) -> dict:
    """ms per call, graphed: fused, the unfused pair, and each of the pair's launches alone."""
    from splitserve.kernels.activation import silu_and_mul
    from splitserve.kernels.fp8_skinny_linear import fp8_skinny_linear_triton as kernel

    weights, scales, counters, gate_ups = ops
    acts = [silu_and_mul(gu, impl="triton") for gu in gate_ups]
    idx = range(len(weights))
    fused = [
        lambda i=i: kernel(gate_ups[i], weights[i], scales[i], counters=counters[i], config=cfg, silu=True) for i in idx
    ]
    unfused = [
        lambda i=i: kernel(
            silu_and_mul(gate_ups[i], impl="triton"), weights[i], scales[i], counters=counters[i], config=cfg
        )
        for i in idx
    ]
    silu = [lambda i=i: silu_and_mul(gate_ups[i], impl="triton") for i in idx]
    gemv = [lambda i=i: kernel(acts[i], weights[i], scales[i], counters=counters[i], config=cfg) for i in idx]
    return {
        f"{name}_ms": graph_ms(fns, device)
        for name, fns in (("fused", fused), ("unfused", unfused), ("silu", silu), ("gemv", gemv))
    }


def _configs(m: int, n: int, k: int, args, device: str) -> list[dict]:
    """The tiles run for M rows: the kernel's own or --fp8-tiles', with --tiles / --dot-tiles over them;
    with --sweep, bench.fp8_linear's W8A16 sweep and SILU_SWEEP after them."""
    from splitserve.kernels._common import num_sms
    from splitserve.kernels.fp8_skinny_linear import fp8_skinny_config, split_k_for

    on_cpu = device != "cuda"
    sms = 1 if on_cpu else num_sms(0)
    cfg = fp8_skinny_config(m, n, k, sms, on_cpu)
    if args.fp8_tiles:
        cfg.update(swept_tiles(args.fp8_tiles).get(("gemv" if m == 1 else "dot", n, k), {}))
    cfg.update(json.loads((args.tiles if m == 1 else args.dot_tiles) or "{}"))
    configs = [cfg]
    if args.sweep:
        wide = [dict(c, SPLIT_K=split_k_for(n, k, c["BLOCK_N"], c["BLOCK_K"], sms)) for c in SILU_SWEEP[m]]
        configs += [c for c in w8a16_configs(m, n, k, sms, on_cpu) + wide if c != cfg]
    return configs


def _tile(c: dict) -> str:
    kind = "dot" if c["DOT"] else "fma"
    return f"{kind} N{c['BLOCK_N']} K{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']} split{c['SPLIT_K']}"


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| M | tiles | fused ms | silu_and_mul + kernel ms | silu ms | kernel alone ms | fused / unfused "
        f"| saved x {LAYERS} layers ms | bit-exact | within bound |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        exact = "yes" if r["exact"] else f"**NO** ({r['mismatched']} differ)"
        lines.append(
            f"| {r['m']} | {_tile(r['config'])} | {r['fused_ms']:.4f} | {r['unfused_ms']:.4f} | {r['silu_ms']:.4f} | "
            f"{r['gemv_ms']:.4f} | {r['fused_ms'] / r['unfused_ms']:.2f} | "
            f"{LAYERS * (r['unfused_ms'] - r['fused_ms']):.3f} | {exact} | {'yes' if r['within_bound'] else '**NO**'} |"
        )
    return lines


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="")
    parser.add_argument("--fp8-tiles", default="", help="a bench/kernels.py --sections fp8linear JSON")
    parser.add_argument("--tiles", default="", help="JSON: tile keys for M = 1 over the kernel's own")
    parser.add_argument("--dot-tiles", default="", help="JSON: tile keys for M = 16 over the kernel's own")
    parser.add_argument("--sweep", action="store_true", help="also bench.fp8_linear's W8A16 tile sweep")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("silu_gemv_gpu: needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    n, k = (40, 100) if args.smoke else (4096, 14336)
    rows = []
    weights = _weights(n, k, copies_for(n * k, device), device)
    for m in (1, 16):
        ops = (*weights, _gate_ups(m, k, len(weights[0]), device))
        for cfg in _configs(m, n, k, args, device):
            row = dict(m=m, n=n, k=k, config=cfg, copies=len(ops[0]), **_check(ops, cfg))
            row.update(_time(ops, cfg, device))
            rows.append(row)
            print(row, flush=True)
    meta = dict(
        device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu (interpreter)",
        torch=torch.__version__,
        commit=_commit(),
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)
    print(f"\n{meta}")
    print("\n".join(table(rows)))
    return 0 if all(r["exact"] and r["within_bound"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
