"""The CPU ops' builds side by side on this machine: the plain loops, AVX2 (8-wide FMA) and, where the
CPU has it, AVX-512; each vector build's result against the plain loops' (largest difference; CPU only).

    python benchmarks/cpu_isa.py [--json out.json]

Shapes are the offline CPU workload's (`benchmarks/configs/llama-32m.json`: 8 q / 4 kv heads, head 64,
hidden 512, FFN 1408, block 16): decode attention at batch 64 x 330 tokens, RMSNorm(+residual) and
SiLU-mul at a decode step (64 rows) and a prefill chunk (2048 rows). One thread, timed as that
thread's CPU time (`time.thread_time`): on a shared machine wall time mostly measures the other
processes. Medians of 30 calls after 5 warm-ups, interleaved across builds (one call of each per round).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def _cases():
    gen = torch.Generator().manual_seed(0)
    batch, ctx, hq, hkv, d, bs = 64, 330, 8, 4, 64, 16
    blocks_per_seq = -(-ctx // bs)
    num_blocks = batch * blocks_per_seq + 8
    kv = torch.randn(num_blocks, 8, 2, bs, hkv, d, generator=gen)  # block-major, 8 layers
    k_cache, v_cache = kv[:, 3, 0], kv[:, 3, 1]
    tables = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq].view(batch, -1).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, hq, d, generator=gen)
    cases = {"decode attention 64 x 330": lambda m: m.paged_decode(q, k_cache, v_cache, tables, lens, 0.125)}
    for rows in (64, 2048):
        x, res, w = torch.randn(rows, 512, generator=gen), torch.randn(rows, 512, generator=gen), torch.randn(512)
        gu = torch.randn(rows, 2 * 1408, generator=gen)
        cases[f"rms_norm+residual {rows} x 512"] = lambda m, x=x, res=res, w=w: m.rms_norm(x, res, w, 1e-6)
        cases[f"silu_and_mul {rows} x 1408"] = lambda m, gu=gu: m.silu_and_mul(gu)
    return cases


def main(argv=None) -> int:
    from splitserve.kernels import cpu_ops

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # every op runs in this thread, so its CPU time is the op's
    order = ["generic", "avx2", "avx512"]
    isas = order[: order.index(cpu_ops.cpu_isa()) + 1]
    builds = {isa: cpu_ops.build_isa(isa) for isa in isas}
    rows = []
    for name, fn in _cases().items():
        outs = {isa: fn(m) for isa, m in builds.items()}
        first = outs[isas[0]][0] if isinstance(outs[isas[0]], list) else outs[isas[0]]
        for _ in range(5):
            for m in builds.values():
                fn(m)
        samples = {isa: [] for isa in isas}
        for _ in range(30):
            for isa, m in builds.items():
                start = time.thread_time()
                fn(m)
                samples[isa].append(1e3 * (time.thread_time() - start))
        row = {"op": name, **{f"{isa}_ms": statistics.median(v) for isa, v in samples.items()}}
        for isa in isas[1:]:
            got = outs[isa][0] if isinstance(outs[isa], list) else outs[isa]
            row[f"{isa}_max_diff"] = (got - first).abs().max().item()
        rows.append(row)
    print(f"CPU: {cpu_ops.cpu_isa()}, one thread, CPU ms per call")
    print(
        "| op | "
        + " | ".join(f"{isa} ms" for isa in isas)
        + " | "
        + " | ".join(f"{i} vs generic" for i in isas[1:])
        + " | "
        + " | ".join(f"{i} max diff" for i in isas[1:])
        + " |"
    )
    print("|---" * (3 * len(isas) - 1) + "|")
    for r in rows:
        times = " | ".join(f"{r[f'{isa}_ms']:.3f}" for isa in isas)
        speed = " | ".join(f"{r['generic_ms'] / r[f'{isa}_ms']:.2f}x" for isa in isas[1:])
        diffs = " | ".join(f"{r[f'{isa}_max_diff']:.1e}" for isa in isas[1:])
        print(f"| {r['op']} | {times} | {speed} | {diffs} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
