"""The fused MoE kernel and a Qwen3-30B-A3B-shape decode step on one GPU, in one call (a few minutes).

    python benchmarks/moe.py                          # on a GPU; JSON to $OUT/moe.json when OUT is set
    python benchmarks/moe.py --layers 16 --json m.json
    TRITON_INTERPRET=1 python benchmarks/moe.py --smoke    # tiny shapes on the CPU: the code paths only

Sections, each on the MoE layer of Qwen3-30B-A3B (hidden 2048, 128 experts, top-8, expert width 768, bf16):
 1. check: the fused kernel against its torch reference in float32 (the largest difference, relative to the
    reference's largest value), at every batch.
 2. layer: per call at batch 1/64/256, the fused kernel replayed from a CUDA graph and launched eagerly, the
    per-expert loop of torch matmuls (kernels.fused_moe_ref, what transformers' eager experts do), and the
    read floor: the weight bytes of the experts the batch hits (its active experts at batch 1, nearly all at
    large batches) at the device's copy rate; then the kernel on e4m3 experts (W8A16, half the bytes). Calls
    cycle over 4 layers' weights, so no call finds its experts in the L2 left by the one before (a decode step).
 3. tiles: a sweep of the fused kernel's tiles per batch; the best are written as a tuned-config file
    (kernels/tuned_configs.py's format) to $OUT (or beside --json), to be copied into kernels' configs/.
 4. decode: the decode step of a dummy-weight model of Qwen3-30B-A3B's shape (as many of its 48 layers as
    fit; the table says how many), replayed from the engine's CUDA graphs (worker/cuda_graphs.py) at
    context 256, beside the same layers' MoE blocks alone in a graph: the MoE share of the step.
Times are medians over repeats of CUDA-event-timed loops, after warm-up. The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from splitserve.engine.worker.fp8 import quantize_per_channel
from splitserve.engine.worker.models.moe import route
from splitserve.engine.worker.moe_config import MoeConfig
from splitserve.kernels.fused_moe import OP, fused_moe, fused_moe_ref
from splitserve.kernels.tuned_configs import config_path

CONFIG = Path(__file__).with_name("configs") / "qwen3-30b-a3b.json"
FULL = dict(hidden=2048, inter=768, experts=128, top_k=8, batches=[1, 64, 256], weight_sets=4, context=256)
SMOKE = dict(hidden=64, inter=32, experts=8, top_k=2, batches=[1, 4], weight_sets=1, context=16)
TILES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    (16, 32, 128, 4, 3),
    (16, 64, 128, 4, 3),
    (16, 64, 256, 4, 2),
    (16, 128, 128, 4, 3),
    (16, 64, 64, 4, 4),
    (32, 64, 128, 4, 3),
    (32, 128, 64, 4, 3),
    (64, 64, 64, 4, 3),
    (64, 128, 64, 4, 3),
    (64, 128, 64, 8, 4),
    (64, 64, 128, 4, 3),
    (128, 128, 64, 8, 3),
]


def time_ms(fn, device: torch.device, iters: int = 20, repeats: int = 7) -> float:
    """Median per-call milliseconds of `fn` over `repeats` loops of `iters` calls, after a warm-up loop
    (CUDA events on a GPU, the wall clock on the CPU)."""
    if device.type != "cuda":  # the smoke run checks the code paths, not the times
        iters, repeats = 1, 1
    samples = []
    for rep in range(repeats + 1):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            began = time.perf_counter()
            for _ in range(iters):
                fn()
            elapsed = (time.perf_counter() - began) * 1e3
        if rep:  # the first loop warms up
            samples.append(elapsed / iters)
    return statistics.median(samples)


def graphed(fn, device: torch.device):
    """`fn` captured in a CUDA graph (returns its replay); on the CPU `fn` itself."""
    if device.type != "cuda":
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_rate(device: torch.device, nbytes: int) -> float:
    """Device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / (time_ms(lambda: dst.copy_(src), device, iters=10) * 1e-3)


class LayerCase:
    """`weight_sets` layers' expert weights and one batch's inputs and routing (Qwen3-MoE's)."""

    def __init__(self, p: dict, batch: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
        gen = torch.Generator(device=device).manual_seed(seed)
        e, h, f = p["experts"], p["hidden"], p["inter"]
        self.weights = [
            (
                torch.empty(e, 2 * f, h, device=device, dtype=dtype).normal_(0, h**-0.5, generator=gen),
                torch.empty(e, h, f, device=device, dtype=dtype).normal_(0, f**-0.5, generator=gen),
            )
            for _ in range(p["weight_sets"])
        ]
        self.x = torch.empty(batch, h, device=device, dtype=dtype).normal_(generator=gen)  # (T, H)
        logits = torch.empty(batch, e, device=device, dtype=dtype).normal_(generator=gen)  # (T, E)
        moe = MoeConfig(e, p["top_k"], f, renormalize=True, weights_in_model_dtype=True, sparse_layers=(0,))
        self.topk_weights, self.topk_ids = route(logits, moe)  # (T, k) each
        self.active_experts = int(torch.unique(self.topk_ids).numel())
        self.read_bytes = self.active_experts * 3 * h * f * self.x.element_size()

    def run(self, impl: str, config: dict | None = None):
        """One call per weight set (the fused kernel, or the reference loop with impl="ref")."""
        for w13, w2 in self.weights:
            fused_moe(self.x, w13, w2, self.topk_weights, self.topk_ids, impl=impl, config=config)

    def to_fp8(self) -> None:
        """The weight sets as e4m3 with per-expert row scales (what --quantization fp8 makes of the experts)."""
        self.fp8 = []
        for w13, w2 in self.weights:
            pair = []
            for w in (w13, w2):
                w_q, scale = quantize_per_channel(w.reshape(-1, w.shape[2]))
                pair += [w_q.view(w.shape), scale.view(w.shape[:2])]
            self.fp8.append(pair)

    def run_fp8(self):
        for w13, s13, w2, s2 in self.fp8:
            fused_moe(self.x, w13, w2, self.topk_weights, self.topk_ids, w13_scale=s13, w2_scale=s2, impl="triton")


def check(p, device, dtype) -> list[dict]:
    rows = []
    for batch in p["batches"]:
        case = LayerCase(p, batch, device, dtype, seed=batch)
        w13, w2 = case.weights[0]
        got = fused_moe(case.x, w13, w2, case.topk_weights, case.topk_ids, impl="triton").float()
        want = fused_moe_ref(case.x.float(), w13.float(), w2.float(), case.topk_weights.float(), case.topk_ids)
        scale = want.abs().max().item()
        rel = (got - want).abs().max().item() / scale
        rows.append(dict(batch=batch, max_rel_diff=rel, ok=rel < 2e-2))
    return rows


def bench_layer(p, device, dtype, rate: float) -> list[dict]:
    rows = []
    for batch in p["batches"]:
        case = LayerCase(p, batch, device, dtype, seed=batch)
        sets = len(case.weights)
        fused_graph = time_ms(graphed(lambda: case.run("triton"), device), device) / sets
        fused_eager = time_ms(lambda: case.run("triton"), device) / sets
        loop = time_ms(lambda: case.run("ref"), device, iters=5, repeats=5) / sets
        floor = case.read_bytes / rate * 1e3
        case.to_fp8()
        case.weights = case.weights[:1]  # the 16-bit sets' memory back, but one
        fp8_graph = time_ms(graphed(case.run_fp8, device), device) / sets
        rows.append(
            dict(
                batch=batch,
                active_experts=case.active_experts,
                read_mb=case.read_bytes / 1e6,
                fused_graph_ms=fused_graph,
                fused_eager_ms=fused_eager,
                torch_loop_ms=loop,
                floor_ms=floor,
                floor_fraction=floor / fused_graph,
                speedup_vs_loop=loop / fused_graph,
                fp8_graph_ms=fp8_graph,
                fp8_floor_fraction=floor / 2 / fp8_graph,
            )
        )
    return rows


def sweep_tiles(p, device, dtype) -> tuple[list[dict], dict]:
    """Each tile config's graphed time per batch; the tuned-config table of the best per batch."""
    rows, table = [], {}
    for batch in p["batches"]:
        case = LayerCase(p, batch, device, dtype, seed=batch)
        times = {}
        for bm, bn, bk, warps, stages in TILES if device.type == "cuda" else TILES[:2]:
            config = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
            try:
                times[(bm, bn, bk, warps, stages)] = time_ms(
                    graphed(lambda c=config: case.run("triton", c), device), device, iters=10, repeats=5
                ) / len(case.weights)
            except Exception as exc:  # a tile that does not fit the device's shared memory
                print(f"tiles {config}: {type(exc).__name__}: {str(exc)[:120]}")
        best = min(times, key=times.get)
        rows.append(
            dict(batch=batch, best=list(best), best_ms=times[best], all_ms={str(k): v for k, v in times.items()})
        )
        tiles = dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), best))
        h, f = p["hidden"], p["inter"]
        table[f"M<={batch}"] = {f"N={2 * f},K={h}": tiles, f"N={h},K={f}": tiles}
    return rows, table


def decode_layers(config: dict, device: torch.device, max_batch: int, context: int, requested: int | None) -> int:
    """How many layers fit: weights and the KV cache within 85% of free memory, less 4 GB of working room."""
    if requested:
        return requested
    if device.type != "cuda":
        return 2
    h, e, f = config["hidden_size"], config["num_experts"], config["moe_intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    per_layer = 2 * (3 * e * h * f + h * (q + 2 * kv) + q * h + e * h)
    blocks = max_batch * (context // 16 + 1) + 1
    per_layer += 2 * blocks * 2 * 16 * kv
    fixed = 2 * 2 * config["vocab_size"] * h
    free = torch.cuda.mem_get_info(device)[0]
    return max(1, min(config["num_hidden_layers"], int((0.85 * free - 4e9 - fixed) // per_layer)))


def decode_meta(tables, slots, seq_lens, context):
    """AttentionMetadata of one decode step (one new token a sequence), as the runner builds it."""
    from splitserve.engine.worker.attention import AttentionMetadata

    batch = tables.shape[0]
    return AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=tables.device),
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping=slots,
        max_query_len=1,
        max_seq_len=context,
        query_start_loc_cpu=list(range(batch + 1)),
        seq_lens_cpu=[context] * batch,
    )


def bench_decode(p, device, dtype, layers: int | None, smoke: bool) -> dict:
    from splitserve.engine.worker.cuda_graphs import DecodeGraphs
    from splitserve.engine.worker.kv_cache import allocate_kv_cache
    from splitserve.engine.worker.loader import load_model

    config = json.loads(CONFIG.read_text())
    if smoke:
        config.update(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
        config.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)
    context, batches = p["context"], p["batches"]
    config["num_hidden_layers"] = decode_layers(config, device, max(batches), context, layers)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(config))
        net, model_config = load_model(path, dtype=dtype, device=device, load_format="dummy")
    block_size, blocks_per_seq = 16, context // 16 + 1
    layout = model_config.kv_layout(block_size, str(dtype).removeprefix("torch."))
    kv = allocate_kv_cache(layout, max(batches) * blocks_per_seq + 1, device).zero_()
    graphs = DecodeGraphs(net, kv, max_num_seqs=max(batches), max_blocks_per_seq=blocks_per_seq)
    graphs.buckets = sorted(batches)  # capture only the batches timed
    if device.type == "cuda":
        graphs.capture()
    result = dict(layers=config["num_hidden_layers"], of_layers=48, context=context, rows=[])
    sparse = [layer.mlp for layer in net.model.layers]
    for batch in batches:
        tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=device).view(batch, -1) + 1
        ids = torch.randint(0, config["vocab_size"], (batch,), device=device)
        positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
        slots = tables[:, (context - 1) // block_size].long() * block_size + (context - 1) % block_size
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        if device.type == "cuda":
            step = time_ms(lambda: graphs.run(ids, positions, slots, seq_lens, tables), device)
        else:  # the smoke run: the model eagerly
            meta = decode_meta(tables, slots, seq_lens, context)
            step = time_ms(lambda: net(ids, positions, kv, meta), device, iters=1, repeats=2)
        hidden = torch.empty(batch, config["hidden_size"], device=device, dtype=dtype).normal_()
        logits = time_ms(lambda: net.compute_logits(hidden), device)
        moe = time_ms(graphed(lambda: [block(hidden) for block in sparse], device), device)
        result["rows"].append(
            dict(batch=batch, step_ms=step, logits_ms=logits, moe_ms=moe, moe_share=moe / (step + logits))
        )
    return result


def print_tables(out: dict) -> None:
    print(f"\ndevice: {out['device']}, copy rate {out['copy_gbps']:.0f} GB/s (read + write)")
    print("\ncheck: fused kernel vs the float32 torch reference")
    for r in out.get("check") or []:
        print(f"  batch {r['batch']:>4}: largest difference {r['max_rel_diff']:.2e} of the largest value  "
              f"{'ok' if r['ok'] else 'MISMATCH'}")  # fmt: skip
    p = out["params"]
    shape = f"H {p['hidden']}, E {p['experts']}, top-{p['top_k']}, F {p['inter']}, {out['dtype']}"
    print(f"\nMoE layer ({shape}), ms per layer (calls cycle over {p['weight_sets']} layers' weights)")
    print(
        "  batch  experts  read MB   fused(graph)  fused(eager)  torch loop   floor   floor/fused  loop/fused"
        "   fp8 W8A16(graph)  fp8 floor/fused"
    )
    for r in out.get("layer") or []:
        print(f"  {r['batch']:>5}  {r['active_experts']:>7}  {r['read_mb']:>7.1f}   {r['fused_graph_ms']:>12.4f}  "
              f"{r['fused_eager_ms']:>12.4f}  {r['torch_loop_ms']:>10.4f}  {r['floor_ms']:>6.4f}  "
              f"{r['floor_fraction']:>11.1%}  {r['speedup_vs_loop']:>9.1f}x   {r['fp8_graph_ms']:>16.4f}  "
              f"{r['fp8_floor_fraction']:>15.1%}")  # fmt: skip
    if out.get("tiles"):
        print("\ntiles: best (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) per batch, graphed ms per layer")
        for r in out["tiles"]:
            print(f"  batch {r['batch']:>4}: {tuple(r['best'])}  {r['best_ms']:.4f}")
    d = out.get("decode")
    if d:
        print(
            f"\ndecode step, dummy Qwen3-30B-A3B shape: {d['layers']} of {d['of_layers']} layers, "
            f"context {d['context']}"
        )
        print("  batch   step ms (graph)  logits ms   MoE ms (graph)   MoE share")
        for r in d["rows"]:
            print(f"  {r['batch']:>5}   {r['step_ms']:>14.3f}  {r['logits_ms']:>9.3f}   {r['moe_ms']:>14.3f}   "
                  f"{r['moe_share']:>9.1%}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (needs TRITON_INTERPRET=1)")
    ap.add_argument("--layers", type=int, default=None, help="decode model layers (default: as many as fit)")
    ap.add_argument("--no-tiles", action="store_true", help="skip the tile sweep")
    ap.add_argument("--json", type=Path, default=None, help="where to write the results (default $OUT/moe.json)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    p = SMOKE if args.smoke else FULL
    dtype = torch.float32 if args.smoke else torch.bfloat16
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    json_path = args.json or (out_dir / "moe.json" if out_dir else None)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = dict(
        device=name,
        params=p,
        dtype=str(dtype).removeprefix("torch."),
        copy_gbps=copy_rate(device, 1 << 30 if device.type == "cuda" else 1 << 22) / 1e9,
    )
    torch.manual_seed(0)
    sections = [
        ("check", lambda: check(p, device, dtype)),
        ("layer", lambda: bench_layer(p, device, dtype, out["copy_gbps"] * 1e9)),
    ]
    if not args.no_tiles:
        sections.append(("tiles", lambda: sweep_tiles(p, device, dtype)))
    sections.append(("decode", lambda: bench_decode(p, device, dtype, args.layers, args.smoke)))
    for key, run in sections:
        began = time.perf_counter()
        try:
            value = run()
        except Exception as exc:  # report the other sections even if one fails
            value = None
            out[f"{key}_error"] = f"{type(exc).__name__}: {exc}"
            print(f"section {key} failed: {out[f'{key}_error']}")
        if key == "tiles" and value is not None:
            value, table = value
            tiles_name = config_path(OP, name, "w16a16").name
            out["tiles_file"] = dict(name=tiles_name, table=table)
            if json_path is not None:
                json_path.parent.mkdir(parents=True, exist_ok=True)
                (json_path.parent / tiles_name).write_text(json.dumps(table, indent=2) + "\n")
        out[key] = value
        print(f"section {key}: {time.perf_counter() - began:.1f} s", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(out, indent=2))
    print_tables(out)
    for key in [k for k in out if k.endswith("_error")]:
        print(f"{key}: {out[key]}")


if __name__ == "__main__":
    main()
