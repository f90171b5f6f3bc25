"""gpt-oss-shape paged decode attention: sinks and sliding windows against plain attention, in one call.

    python benchmarks/gpt_oss_attention.py                 # on a GPU; JSON to $OUT/gpt_oss_attention.json if set
    python benchmarks/gpt_oss_attention.py --contexts 1024 --json a.json
    TRITON_INTERPRET=1 python benchmarks/gpt_oss_attention.py --smoke    # tiny shapes on the CPU: code paths only

gpt-oss-20b and -120b share one attention shape: 64 query heads, 8 KV heads, head_dim 64, block 16 (ours), a
learned sink per head in every layer, and a 128-token window in every other layer. Per (cache dtype, batch,
context), each a CUDA-graph replay of `kernels.paged_decode_attention` as the engine's decode graphs run it
(split-K chosen from the table's width, as in the engine):
  plain    no sinks, no window: the kernel a Llama-family model gets (an e4m3 cache: its fp8 variant);
  sinks    a full-attention layer of gpt-oss (sinks, no window; the upcast kernel);
  window   a sliding layer of gpt-oss (sinks and the 128-token window; the upcast kernel);
  step     the mean of sinks and window: gpt-oss's per-layer cost, alternating layers.
Each beside its read floor: the KV bytes the layer must read (every token of the context; the last 128 for
the window) at the device's copy rate. Calls cycle over `--layers` layers' caches so no call finds its keys in
the L2 the one before left. `check`: each variant's largest difference from the torch reference at the first
batch, relative to the reference's largest value. Times are medians of CUDA-event-timed loops after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from moe import copy_rate, graphed, time_ms

from splitserve.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref

FULL = dict(heads=64, kv_heads=8, head_dim=64, block=16, window=128, batches=[1, 64, 256], contexts=[1024, 8192])
SMOKE = dict(heads=4, kv_heads=2, head_dim=16, block=4, window=8, batches=[1, 2], contexts=[24])
VARIANTS = ("plain", "sinks", "window")


class DecodeCase:
    """`layers` layers' paged caches for `batch` sequences of `context` tokens each (distinct blocks), one query
    token per sequence, and a sink per head."""

    def __init__(self, p: dict, batch: int, context: int, layers: int, cache_dtype, device: torch.device):
        gen = torch.Generator(device=device).manual_seed(batch + context)
        blocks_per_seq = -(-context // p["block"])
        num_blocks = batch * blocks_per_seq
        shape = (num_blocks, layers, 2, p["block"], p["kv_heads"], p["head_dim"])  # the engine's block-major pool
        kv = torch.empty(shape, device=device, dtype=torch.bfloat16).normal_(generator=gen)
        self.kv = kv.to(cache_dtype)
        del kv
        order = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
        self.block_tables = order.view(batch, blocks_per_seq)  # (B, blocks)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.q = torch.empty(batch, p["heads"], p["head_dim"], device=device, dtype=torch.bfloat16).normal_(
            generator=gen
        )  # (B, Hq, D)
        self.sinks = torch.empty(p["heads"], device=device, dtype=torch.bfloat16).normal_(generator=gen)
        self.out = torch.empty_like(self.q)
        self.scale = p["head_dim"] ** -0.5
        self.layers, self.window = layers, p["window"]
        token_bytes = 2 * p["kv_heads"] * p["head_dim"] * self.kv.element_size()  # one token's K and V
        self.read_bytes = {
            "plain": batch * context * token_bytes,
            "sinks": batch * context * token_bytes,
            "window": batch * min(context, self.window) * token_bytes,
        }

    def extras(self, variant: str) -> dict:
        if variant == "plain":
            return {}
        return dict(sinks=self.sinks, sliding_window=self.window if variant == "window" else None)

    def caches(self, layer: int):
        return self.kv[:, layer, 0], self.kv[:, layer, 1]  # (N, bs, Hkv, D) each

    def run(self, variant: str, impl: str = "auto"):
        """One call per layer."""
        extras = self.extras(variant)
        for layer in range(self.layers):
            k_cache, v_cache = self.caches(layer)
            paged_decode_attention(
                self.q, k_cache, v_cache, self.block_tables, self.seq_lens, self.scale, out=self.out, impl=impl,
                **extras,
            )  # fmt: skip

    def error(self, variant: str, impl: str) -> float:
        """The variant's largest difference from the reference over layer 0, relative to its largest value."""
        k_cache, v_cache = self.caches(0)
        args = (self.q, k_cache, v_cache, self.block_tables, self.seq_lens, self.scale)
        got = paged_decode_attention(*args, impl=impl, **self.extras(variant)).float()
        want = paged_decode_attention_ref(*args, **self.extras(variant)).float()
        return float((got - want).abs().max() / want.abs().max())


def bench(p: dict, device: torch.device, cache_dtype, layers: int, rate: float) -> list[dict]:
    rows = []
    impl = "triton"
    for context in p["contexts"]:
        for i, batch in enumerate(p["batches"]):
            case = DecodeCase(p, batch, context, layers, cache_dtype, device)
            row = dict(cache=str(cache_dtype).removeprefix("torch."), batch=batch, context=context)
            for variant in VARIANTS:
                if i == 0:
                    row[f"{variant}_check"] = case.error(variant, impl)
                replay = graphed(lambda v=variant, c=case: c.run(v, impl), device)
                row[f"{variant}_ms"] = time_ms(replay, device) / layers
                row[f"{variant}_floor_ms"] = case.read_bytes[variant] / rate * 1e3
            row["step_ms"] = (row["sinks_ms"] + row["window_ms"]) / 2
            rows.append(row)
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'cache':>13} {'batch':>5} {'ctx':>5} | {'plain ms':>8} {'floor':>6} | {'sinks ms':>8} {'x plain':>7} | "
        f"{'window ms':>9} {'x plain':>7} {'floor':>6} | {'step ms':>7} {'x plain':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['cache']:>13} {r['batch']:>5} {r['context']:>5} | {r['plain_ms']:8.4f} "
            f"{r['plain_floor_ms'] / r['plain_ms']:6.2f} | {r['sinks_ms']:8.4f} {r['sinks_ms'] / r['plain_ms']:7.2f} | "
            f"{r['window_ms']:9.4f} {r['window_ms'] / r['plain_ms']:7.2f} {r['window_floor_ms'] / r['window_ms']:6.2f}"
            f" | {r['step_ms']:7.4f} {r['step_ms'] / r['plain_ms']:7.2f}"
        )
    checks = [(r["cache"], v, r[f"{v}_check"]) for r in rows for v in VARIANTS if f"{v}_check" in r]
    print("check (largest |kernel - reference| / largest |reference|):")
    for cache, variant, err in checks:
        print(f"  {cache:>13} {variant:>6}: {err:.2e}")
    print("floor: the read floor's share of the time (1.00 = at the copy rate); x plain: time / plain's time")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (needs TRITON_INTERPRET=1)")
    ap.add_argument("--layers", type=int, default=4, help="layers' caches the calls cycle over (default 4)")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="context lengths (default 1024 8192)")
    ap.add_argument("--json", type=Path, default=None, help="where to write the results (default $OUT/...)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    p = dict(SMOKE if args.smoke else FULL)
    if args.contexts:
        p["contexts"] = args.contexts
    layers = 1 if args.smoke else args.layers
    rate = copy_rate(device, 1 << (16 if args.smoke else 30))
    out = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", shape=p, copy_rate=rate)
    out["rows"] = []
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        out["rows"] += bench(p, device, cache_dtype, layers, rate)
    print(f"device: {out['device']}; copy rate {rate / 1e9:.0f} GB/s; shape {p}")
    print_table(out["rows"])
    path = args.json or (Path(os.environ["OUT"]) / "gpt_oss_attention.json" if os.environ.get("OUT") else None)
    if path is not None:
        path.write_text(json.dumps(out, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
