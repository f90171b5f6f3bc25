"""The nccl transport between tensor-parallel sizes: one prompt's KV pulled by a decode of TP d from a prefill of
TP p, per (p, d), through the connectors alone (no services), checked exact and timed.

    python benchmarks/nccl_tp_handoff.py --json $OUT/nccl_tp.json      (GPUs: every pair that fits, p + d GPUs)
    python benchmarks/nccl_tp_handoff.py --smoke                       (CPU, gloo: a tiny shape, to check it)

The prefill (a process of its own, GPUs 0..p-1) and the decode (this process, GPUs p..p+d-1) each place every
rank's pool as a TP instance's rank 0 does (kv_connectors/rank_pools.py) and pair: one group per (prefill rank,
decode rank) the transfer plan joins. The prefill's pools hold a pattern naming each value's block, layer, K/V
and model head (small integers, exact in bf16); each pull's blocks are checked on every decode rank against it,
then `--repeats` pulls are timed (wall time of `pull`, which returns once every decode rank's heads are in place;
the prefill's send starts when the decode asks for it). Default shape: Llama-3-8B's KV (32 layers, 8 KV heads of
128, bf16, 16-token blocks), a 2,048-token prompt: 256 MiB of KV at TP 1. Pairs of equal TP are the baseline.
The table is printed last; `--json` keeps the rows.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import time
from types import SimpleNamespace

import torch

from splitserve.common.kv_layout import KvLayout
from splitserve.engine.kv_connectors.base import PullTarget
from splitserve.engine.kv_connectors.factory import make_connector
from splitserve.engine.worker.tensor_parallel import kv_heads_of_rank

GPU_PAIRS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4), (4, 4)]
SMOKE_PAIRS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4)]


def layout_of(shape: dict, size: int) -> KvLayout:
    ranks = [tuple(kv_heads_of_rank(shape["kv_heads"], size, r)) for r in range(size)] if size > 1 else []
    return KvLayout(
        num_layers=shape["layers"],
        num_kv_heads=len(ranks[0]) if ranks else shape["kv_heads"],
        head_dim=shape["head_dim"],
        block_size=shape["block_size"],
        dtype=shape["dtype"],
        model_id="nccl-tp-bench",
        tensor_parallel_size=size,
        rank_kv_heads=tuple(ranks),
    )


def pattern(blocks: list[int], layout: KvLayout, heads: list[int], device) -> torch.Tensor:
    """(n, L, 2, bs, len(heads), D): each value names its block, layer, K/V and model head (< 256: exact)."""
    b = torch.tensor(blocks, device=device).view(-1, 1, 1, 1, 1, 1)
    layer = torch.arange(layout.num_layers, device=device).view(1, -1, 1, 1, 1, 1)
    kv = torch.arange(2, device=device).view(1, 1, -1, 1, 1, 1)
    h = torch.tensor(heads, device=device).view(1, 1, 1, 1, -1, 1)
    value = (b * 13 + layer * 5 + kv * 3 + h * 29) % 251
    shape = (len(blocks), layout.num_layers, 2, layout.block_size, len(heads), layout.head_dim)
    return value.expand(shape).to(getattr(torch, layout.dtype))


def run_prefill(shape, size, num_blocks, device, port, backend, commands, results) -> None:
    """The prefill side: place, fill, pair as rank 1, then send what the decode asks for until told to stop."""
    layout = layout_of(shape, size)
    io = make_connector({"transport": "nccl", "instance": "bench-p", "role": "prefill", "timeout_s": 60})
    pool = io.kv_cache_factory(layout, num_blocks, torch.device(device))
    pools = io._rank_pools.tensors if io._rank_pools is not None else [pool]
    for rank, rank_pool in enumerate(pools):
        rank_pool.copy_(pattern(list(range(num_blocks)), layout, list(layout.heads_of_rank(rank)), rank_pool.device))
    io.pair("bench-p->bench-d", 1, "127.0.0.1", port, backend, torch.device(device))
    results.put("paired")
    while (command := commands.get()) is not None:
        results.put(io.send("bench-p->bench-d", command[0], pool, tag=command[1]))
    io.close()


def run_pair(shape, prefill_tp, decode_tp, args) -> dict:
    backend = "gloo" if args.smoke else "nccl"
    device = (lambda i: "cpu") if args.smoke else (lambda i: f"cuda:{i}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    num_blocks = args.prompt_len // shape["block_size"] + 4
    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    prefill = ctx.Process(
        target=run_prefill, args=(shape, prefill_tp, num_blocks, device(0), port, backend, commands, results)
    )
    prefill.start()
    layout_p, layout_d = layout_of(shape, prefill_tp), layout_of(shape, decode_tp)
    io = make_connector({"transport": "nccl", "instance": "bench-d", "role": "decode", "timeout_s": 60})
    try:
        pool = io.kv_cache_factory(layout_d, num_blocks, torch.device(device(prefill_tp)))
        io.pair("bench-p->bench-d", 0, "127.0.0.1", port, backend, pool.device)
        assert results.get(timeout=120) == "paired"
        links = len(io.groups["bench-p->bench-d"].links) if prefill_tp * decode_tp > 1 else 1
        n = args.prompt_len // shape["block_size"]
        src = list(range(2, 2 + n))  # consecutive, as a fresh prefill's blocks mostly are
        dst = list(range(num_blocks - n, num_blocks))
        spec = SimpleNamespace(
            transport="nccl", prefill_instance="bench-p", block_ids=src, tag=1, request_id="r", layout=layout_p
        )
        target = PullTarget(pool, lambda need: commands.put(([src[i] for i in need.block_indices], spec.tag)))
        times, moved = [], None
        for i in range(args.repeats + 1):
            for rank_pool in io._rank_pools.tensors if io._rank_pools is not None else [pool]:
                rank_pool[dst] = 0
            start = time.perf_counter()
            moved = io.pull(spec, list(range(n)), dst, target)
            elapsed = time.perf_counter() - start
            sent = results.get(timeout=120)
            if i == 0:
                exact = check(io, pool, layout_d, src, dst)
            else:
                times.append(elapsed)
        commands.put(None)
        prefill.join(60)
        ms = 1e3 * statistics.median(times)
        return {
            "prefill_tp": prefill_tp,
            "decode_tp": decode_tp,
            "links": links,
            "bytes": moved.num_bytes,
            "bytes_sent": sent["num_bytes"],
            "pull_ms_median": round(ms, 3),
            "gb_per_s": round(moved.num_bytes / ms / 1e6, 2),
            "exact": exact,
        }
    finally:
        io.close()
        if prefill.is_alive():
            prefill.kill()


def check(io, pool, layout: KvLayout, src: list[int], dst: list[int]) -> bool:
    """Every decode rank's destination blocks hold exactly its heads of the source blocks' pattern."""
    pools = io._rank_pools.tensors if io._rank_pools is not None else [pool]
    return all(
        torch.equal(p[dst], pattern(src, layout, list(layout.heads_of_rank(rank)), p.device))
        for rank, p in enumerate(pools)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU and gloo, a tiny shape")
    parser.add_argument("--pairs", default="", help="p:d,... (default: every pair that fits the GPUs)")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if args.smoke:
        shape = {"layers": 2, "kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": "float32"}
        args.prompt_len, args.repeats = min(args.prompt_len, 64), min(args.repeats, 3)
        pairs = SMOKE_PAIRS
    else:
        shape = {"layers": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16, "dtype": "bfloat16"}
        gpus = torch.cuda.device_count()
        pairs = [pair for pair in GPU_PAIRS if sum(pair) <= gpus]
    if args.pairs:
        pairs = [tuple(int(x) for x in pair.split(":")) for pair in args.pairs.split(",")]
    rows = [run_pair(shape, p, d, args) for p, d in pairs]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": shape, "prompt_len": args.prompt_len, "rows": rows}, f, indent=1)
    print(f"{'pair':>6} {'links':>5} {'MiB':>8} {'pull ms':>9} {'GB/s':>7} exact")
    for row in rows:
        pair = f"{row['prefill_tp']},{row['decode_tp']}"
        mib = row["bytes"] / 2**20
        print(
            f"{pair:>6} {row['links']:>5} {mib:8.2f} {row['pull_ms_median']:9.3f} {row['gb_per_s']:7.2f} {row['exact']}"
        )


if __name__ == "__main__":
    main()
