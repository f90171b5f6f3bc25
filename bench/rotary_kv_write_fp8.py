"""The fused rotary + KV write into an fp8 cache against the two launches it replaces (issue 19).

    bash bench/rotary_kv_write_fp8.sh                               # on the GPU box: install, bench, GPU tests
    python -m bench.rotary_kv_write_fp8 --json OUT.json             # the bench alone (splitserve installed)
    TRITON_INTERPRET=1 python -m bench.rotary_kv_write_fp8 --dry-run  # CPU: tiny shapes, every code path

Llama-3-8B attention (Hq 32, Hkv 8, head 128, block 16), bf16 q/k/v, T = 1 (a batch-1 decode step) and 128
tokens, into a block-major cache of 32 layers, e4m3 with k_scale 0.37 / v_scale 2.5 (and 1.0 / 1.0 checked),
and a bf16 cache beside it. Check: `kernels.rotary_kv_write` leaves the cache bytes, q and k bit for bit
what `kernels.rotary_embedding` then `kernels.write_kv` (the unfused path of engine.attention) leave, one
slot -1 (padding) row at T = 128. Time: 32 calls, one per layer (each its own q/k/v and cache layer, as a
decode step makes them), captured in one CUDA graph and replayed; us per layer = replay time / 32. The
unfused row is the two launches per layer; the saving at T = 1 is what a batch-1 decode step gains.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from splitserve.kernels import write_kv
from splitserve.kernels.rotary import build_cos_sin_cache, rotary_embedding
from splitserve.kernels.rotary_kv_write import rotary_kv_write

FP8 = torch.float8_e4m3fn
FULL = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, num_layers=32, tokens=(1, 128), reps=50)
DRY = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=4, num_layers=2, tokens=(1, 6), reps=2)
SCALES = [(0.37, 2.5), (1.0, 1.0)]  # the first is the one timed


class Step:
    """One step's inputs for every layer: qkv (L, T, (Hq + 2 Hkv) D) split into q/k/v views, positions,
    slots (one -1 when T > 1), and a block-major cache (N, L, 2, bs, Hkv, D) with each layer's k/v views."""

    def __init__(self, p, num_tokens, cache_dtype, device, seed=0):
        gen = torch.Generator().manual_seed(seed)
        hq, hkv, d, bs, layers = p["num_q_heads"], p["num_kv_heads"], p["head_dim"], p["block_size"], p["num_layers"]
        self.qkv = (torch.randn(layers, num_tokens, (hq + 2 * hkv) * d, generator=gen) * 2).to(device, torch.bfloat16)
        self.q = self.qkv[..., : hq * d].unflatten(-1, (hq, d))  # (L, T, Hq, D)
        self.k = self.qkv[..., hq * d : (hq + hkv) * d].unflatten(-1, (hkv, d))  # (L, T, Hkv, D)
        self.v = self.qkv[..., (hq + hkv) * d :].unflatten(-1, (hkv, d))
        num_blocks = num_tokens // bs + 4
        self.kv = torch.zeros(num_blocks, layers, 2, bs, hkv, d, dtype=cache_dtype, device=device)
        slots = torch.randperm(num_blocks * bs, generator=gen)[:num_tokens]
        if num_tokens > 1:
            slots[num_tokens // 2] = -1  # a padding row: nothing written
        self.slots = slots.to(device)
        self.positions = torch.randint(0, 8192, (num_tokens,), generator=gen).to(device)
        self.cos_sin = build_cos_sin_cache(d, 8192, 500000.0, None, torch.bfloat16, device=device)

    def layer(self, i):
        return self.q[i], self.k[i], self.v[i], self.kv[:, i, 0], self.kv[:, i, 1]


def fused(step, i, k_scale, v_scale):
    q, k, v, k_cache, v_cache = step.layer(i)
    rotary_kv_write(step.positions, q, k, v, k_cache, v_cache, step.slots, step.cos_sin, "triton", k_scale, v_scale)


def unfused(step, i, k_scale, v_scale):
    q, k, v, k_cache, v_cache = step.layer(i)
    rotary_embedding(step.positions, q, k, step.cos_sin, impl="triton")
    write_kv(k, v, k_cache, v_cache, step.slots, impl="triton", k_scale=k_scale, v_scale=v_scale)


VARIANTS = {"fused": fused, "unfused": unfused}


def check(p, num_tokens, cache_dtype, k_scale, v_scale, device) -> bool:
    """Both paths from the same inputs, every layer: cache bytes, q and k equal (bitwise)."""
    a, b = Step(p, num_tokens, cache_dtype, device), Step(p, num_tokens, cache_dtype, device)
    for i in range(p["num_layers"]):
        fused(a, i, k_scale, v_scale)
        unfused(b, i, k_scale, v_scale)
    same_kv = torch.equal(a.kv.view(torch.uint8), b.kv.view(torch.uint8))
    same_qkv = torch.equal(a.qkv.view(torch.int16), b.qkv.view(torch.int16))
    written = int((b.kv[:, 0, 0].float() != 0).flatten(2).any(-1).sum())  # layer 0's key slots written
    want_written = int((b.slots >= 0).sum())
    return same_kv and same_qkv and written == want_written


def time_us_per_layer(p, num_tokens, cache_dtype, fn, device) -> float:
    """Median us per layer of `fn` over all layers: a CUDA graph of the L calls, replayed (wall in the dry run)."""
    step = Step(p, num_tokens, cache_dtype, device)
    k_scale, v_scale = SCALES[0]
    layers = p["num_layers"]

    def all_layers():
        for i in range(layers):
            fn(step, i, k_scale, v_scale)

    all_layers()  # compile
    if device != "cuda":
        start = time.perf_counter()
        all_layers()
        return (time.perf_counter() - start) * 1e6 / layers
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        all_layers()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        all_layers()
    for _ in range(5):
        graph.replay()
    samples = []
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(p["reps"]):
        begin.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) * 1e3 / (10 * layers))
    return statistics.median(samples)


def run(p, device) -> dict:
    checks, rows = [], []
    for num_tokens in p["tokens"]:
        for cache_dtype in (FP8, torch.bfloat16):
            for k_scale, v_scale in SCALES if cache_dtype == FP8 else SCALES[1:]:
                ok = check(p, num_tokens, cache_dtype, k_scale, v_scale, device)
                checks.append(dict(tokens=num_tokens, cache=str(cache_dtype), k_scale=k_scale, v_scale=v_scale, ok=ok))
                print(f"check T={num_tokens} {cache_dtype} scales {k_scale}/{v_scale}: {'equal' if ok else 'DIFFER'}")
            times = {name: time_us_per_layer(p, num_tokens, cache_dtype, fn, device) for name, fn in VARIANTS.items()}
            rows.append(dict(tokens=num_tokens, cache=str(cache_dtype), **{f"{n}_us": t for n, t in times.items()}))
            print(f"time T={num_tokens} {cache_dtype}: " + ", ".join(f"{n} {t:.2f} us" for n, t in times.items()))
    return dict(shape=p, checks=checks, rows=rows)


def table(result) -> str:
    layers = result["shape"]["num_layers"]
    lines = [
        f"{'T':>4} {'cache':<16} {'fused us':>9} {'unfused us':>11} {'saved us':>9} {'x':>6} "
        f"{f'saved/step ({layers} layers) ms':>28}"
    ]
    for r in result["rows"]:
        saved = r["unfused_us"] - r["fused_us"]
        lines.append(
            f"{r['tokens']:>4} {r['cache'].removeprefix('torch.'):<16} {r['fused_us']:>9.2f} {r['unfused_us']:>11.2f} "
            f"{saved:>9.2f} {r['unfused_us'] / r['fused_us']:>6.2f} {saved * layers / 1e3:>28.4f}"
        )
    bad = [c for c in result["checks"] if not c["ok"]]
    lines.append(
        f"bitwise checks: {len(result['checks']) - len(bad)}/{len(result['checks'])} equal"
        + (f"; DIFFER: {bad}" if bad else "")
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="", help="write the checks and times here")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.dry_run:
        parser.error("no CUDA device: run with --dry-run (and TRITON_INTERPRET=1) on CPU")
    p = DRY if args.dry_run else FULL
    result = run(p, device)
    result["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(table(result))
    return 0 if all(c["ok"] for c in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
