"""How fast a Triton program can only read a paged KV cache the way the decode kernels do (issue 19): the
ceiling of the access pattern, apart from any attention math.

    python3 -m bench.paged_read --json OUT.json     # on a GPU (splitserve installed)

Each program reads one (sequence, KV head, split)'s keys and values as int32 words, BLOCK_N tokens a tile
through the block table, exactly the addresses of kernels/paged_decode_attention_fp8.py's "rows" variant
(HEADS_FIRST grid), and folds them into one word (xor) it stores, so nothing is read twice and no math hides
the loads. Rows: fp8 and bf16 caches (Llama-3-8B attention shapes, bench/kernels.py's PagedCache: 4 layers,
shuffled tables) over tiles and split counts; % copy = bytes read / time against a device copy in the same
run. If this reads near the copy rate where the fp8 attention kernel reads at 55-60%, the attention's own
work (not the addresses) holds it back.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

from bench.kernels import PagedCache, copy_bandwidth, time_ms
from splitserve.kernels.paged_decode_attention import choose_num_splits

P = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, num_layers=4, tokens=131072)
SHAPES = [(64, 2048), (256, 512), (4, 32768)]


@triton.jit
def _read_kernel(
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    num_splits,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_btb,
    PAGE: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    n = tl.arange(0, BLOCK_N)
    j = tl.arange(0, WORDS)
    acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.int32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + n
        blk = tl.load(bt_row + tok // PAGE, mask=tok < end, other=0).to(tl.int64)
        slot = tok % PAGE
        k_off = (blk * stride_kb + slot * stride_kt + kvh * stride_kh)[:, None] + j[None, :]
        v_off = (blk * stride_vb + slot * stride_vt + kvh * stride_vh)[:, None] + j[None, :]
        mask = (tok < end)[:, None]
        acc ^= tl.load(k_ptr + k_off, mask=mask, other=0) ^ tl.load(v_ptr + v_off, mask=mask, other=0)
    folded = tl.reduce(acc, None, _xor)
    tl.store(out_ptr + (b * tl.num_programs(0) + kvh) * num_splits + split, folded)


@triton.jit
def _xor(a, b):
    return a ^ b


def run_read(k, v, table, seq_lens, splits, block_n, warps, stages):
    kw, vw = k.view(torch.int32), v.view(torch.int32)
    batch, num_kv_heads = table.shape[0], k.shape[2]
    out = torch.empty(batch * num_kv_heads * splits, dtype=torch.int32, device=k.device)
    _read_kernel[(num_kv_heads, batch, splits)](
        kw,
        vw,
        table,
        seq_lens,
        out,
        splits,
        *kw.stride()[:3],
        *vw.stride()[:3],
        table.stride(0),
        PAGE=k.shape[1],
        WORDS=kw.shape[3],
        BLOCK_N=block_n,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "paged_read.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("paged_read: needs a GPU")
    gen = torch.Generator().manual_seed(0)
    copy_bw = copy_bandwidth("cuda", 2 << 30)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cache = PagedCache(P, "cuda", torch.bfloat16)
    caches = {"bf16": (cache.k_cache, cache.v_cache)}
    kv8 = cache.kv.to(torch.float8_e4m3fn)
    caches["fp8"] = (kv8[:, 1, 0], kv8[:, 1, 1])
    rows = []
    print(f"copy rate {copy_bw / 1e9:.0f} GB/s; ms (% copy) per shape {SHAPES}", flush=True)
    for name, (k, v) in caches.items():
        lens = [torch.full((b,), ctx, dtype=torch.int32, device="cuda") for b, ctx in SHAPES]
        tables = [(cache.tables(b, ctx, gen), seq_lens) for (b, ctx), seq_lens in zip(SHAPES, lens)]
        for block_n, warps, stages in ((64, 4, 2), (64, 4, 1), (128, 4, 2), (128, 8, 2), (256, 8, 2), (32, 4, 2)):
            for split_scale in (1, 2):
                cells = []
                for (b, ctx), (table, seq_lens) in zip(SHAPES, tables):
                    splits = choose_num_splits(b, P["num_kv_heads"], ctx, sms) * split_scale
                    ms = time_ms(lambda: run_read(k, v, table, seq_lens, splits, block_n, warps, stages))
                    nbytes = 2 * b * ctx * P["num_kv_heads"] * P["head_dim"] * k.element_size()
                    pct = 100 * nbytes / (ms * 1e-3) / copy_bw
                    rows.append(dict(cache=name, shape=(b, ctx), BLOCK_N=block_n, warps=warps, stages=stages,
                                     splits=splits, ms=ms, pct_copy=pct))  # fmt: skip
                    cells.append(f"{ms:.4f} ({pct:.0f}%, S{splits})")
                print(f"  {name} N{block_n} w{warps} s{stages} splits x{split_scale}: " + " | ".join(cells), flush=True)
    with open(args.json, "w") as f:
        json.dump(dict(copy_gbps=copy_bw / 1e9, device=torch.cuda.get_device_name(0), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
