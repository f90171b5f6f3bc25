"""A KV pull's block copy on one GPU: blocks in one run against a fragmented pool, each way of copying them.

    python benchmarks/block_copy.py --json out/block_copy.json           # on a GPU
    TRITON_INTERPRET=1 python benchmarks/block_copy.py --smoke           # tiny shapes, CPU

For each block shape (Qwen3-0.6B's and Llama-3-8B's, bf16, 16 tokens a block) and block count (a 2,048- and a
32,768-token prompt), it copies the same blocks from one pool into another on one GPU:
  one run    - the source and destination blocks consecutive: one `copy_` (the ceiling: a plain copy)
  per run    - blocks in random order: one `copy_` a block (what a fragmented pull did up to 16 runs)
  gather     - the same: `index_select` into a staging tensor, then `index_copy_` (past 16 runs, before)
  kernel     - the same: `splitserve.kernels.block_copy.copy_blocks_by_index` (past 16 runs, now)
and prints each as the time (median of CUDA-event timings after a warm-up) and the rate over the bytes moved
(read + written, as the copy rate is quoted), with the ratio to the one-run copy. Checks every way's bytes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

import torch

from splitserve.engine.kv_connectors.shm_pool import copy_blocks
from splitserve.kernels.block_copy import copy_blocks_by_index

SHAPES = {  # name -> one block's shape (layers, K/V, tokens, KV heads, head dim)
    "qwen3-0.6b": (28, 2, 16, 8, 128),
    "llama3-8b": (32, 2, 16, 8, 128),
}


def timed(fn, device: str, repeats: int) -> float:
    """Median ms of `fn` over `repeats` runs after one warm-up."""
    fn()
    if device == "cpu":
        import time

        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    times = []
    for _ in range(repeats):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        events[0].record()
        fn()
        events[1].record()
        events[1].synchronize()
        times.append(events[0].elapsed_time(events[1]))
    return statistics.median(times)


def run_case(name: str, block_shape: tuple, num_blocks: int, device: str, repeats: int) -> list[dict]:
    src = torch.randn(num_blocks, *block_shape, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    rng = random.Random(0)
    src_ids, dst_ids = rng.sample(range(num_blocks), num_blocks), rng.sample(range(num_blocks), num_blocks)
    expected = src[torch.tensor(src_ids, device=device)]

    def per_run():
        for s, d in zip(src_ids, dst_ids):
            dst[d : d + 1].copy_(src[s : s + 1], non_blocking=True)

    ways = {
        "one run": lambda: dst.copy_(src, non_blocking=True),
        "per run": per_run,
        "gather": lambda: copy_blocks(src, src_ids, dst, dst_ids),
        "kernel": lambda: copy_blocks_by_index(src, src_ids, dst, dst_ids),
    }
    nbytes = src.numel() * src.element_size()
    rows = []
    for way, fn in ways.items():
        dst.zero_()
        ms = timed(fn, device, repeats)
        ok = (
            torch.equal(dst, src)
            if way == "one run"
            else torch.equal(dst[torch.tensor(dst_ids, device=device)], expected)
        )
        rows.append(dict(shape=name, blocks=num_blocks, way=way, ms=ms, gb_s=2 * nbytes / ms / 1e6, exact=ok))
    base = rows[0]["ms"]
    for row in rows:
        row["vs_one_run"] = base / row["ms"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, the interpreter)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        cases = [("tiny", (2, 2, 4, 2, 8), 6)]
    else:
        cases = [(name, shape, n) for name, shape in SHAPES.items() for n in (128, 2048)]
    rows = [row for name, shape, n in cases for row in run_case(name, shape, n, device, args.repeats)]
    print(f"{'shape':<12}{'blocks':>7}  {'way':<9}{'ms':>9}{'GB/s':>9}{'vs one run':>11}  exact")
    for r in rows:
        print(
            f"{r['shape']:<12}{r['blocks']:>7}  {r['way']:<9}{r['ms']:>9.3f}{r['gb_s']:>9.0f}"
            f"{r['vs_one_run']:>10.0%}  {r['exact']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
