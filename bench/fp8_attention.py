"""FP8 paged decode attention: every tile variant beside the bf16 kernel, against the copy rate (issue 19).

    bash bench/fp8_attention.sh                                   # on the GPU box: install, bench, GPU tests
    python -m bench.fp8_attention --json OUT.json                 # the bench alone (splitserve installed)
    TRITON_INTERPRET=1 python -m bench.fp8_attention --dry-run    # CPU: tiny shapes, every code path
    CONFIGS='{"tokens": {...}}' bash bench/fp8_attention.sh        # confirm: only those configs, no sweep

Llama-3-8B attention (Hq 32, Hkv 8, head 128, block 16) at (B, ctx) = (64, 2048), (256, 512), (4, 32768),
over a block-major cache of 4 layers with shuffled block tables (bench/kernels.py's PagedCache). Per shape:
the bf16 kernel over a bf16 cache, then the same values rounded to e4m3 read by each fp8 variant
(kernels/paged_decode_attention_fp8.py, and the upcast kernel that is the default today). Correctness:
max |fp8 variant - the bf16 kernel over the e4m3 values upcast to bf16| (same inputs; bf16 output rounding
is ~4e-3 of |out|), flagged when above TOL_REL of max |reference|. Phase 1 times every variant on a tile
sweep (BLOCK_N, warps, stages); phase 2 takes each variant's best tile (least total ms over the shapes)
and tries CONV 1 (bit conversion), HEADS_FIRST, BLOCK_G 8 (tokens variants), PREFETCH (rows, tokens),
HEADS_PER_PROGRAM 2/4/8 (rows), and
split counts at the split shape. % copy = bytes the kernel reads (each K/V element of the context once) /
time, against a plain device copy (read + write counted) measured in the same run. A time budget (--budget-s) stops the
sweep early; what ran is still tabulated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from bench.kernels import PagedCache, copy_bandwidth, time_graph_ms, time_ms
from splitserve.kernels import paged_decode_attention_fp8_mma as fp8_mma
from splitserve.kernels.paged_decode_attention import (
    FP8_UPCAST_TILE,
    choose_num_splits,
    decode_config,
    paged_decode_attention_triton,
)

FP8 = torch.float8_e4m3fn
FULL = dict(
    num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, num_layers=4, tokens=131072,
    shapes=[(64, 2048), (256, 512), (4, 32768)],
)  # fmt: skip
# the dry run: a split shape too ((1, 512) takes 2 splits with the interpreter's 4 "SMs")
DRY = dict(
    num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16, num_layers=2, tokens=1024, shapes=[(2, 64), (1, 512)]
)
TOL_REL = 2e-2  # of max |reference|: bf16 output rounding is 2^-9, the e4m3 q of tokens_qk8 ~5e-2
VARIANTS = ["rows", "tokens", "tokens_qk8x2", "tokens_qk8"]
# most likely first: when the budget runs out, every variant has had the same leading tiles
TILES = [
    dict(BLOCK_N=n, num_warps=w, num_stages=s)
    for n, w, s in ((128, 4, 2), (64, 4, 2), (128, 8, 2), (128, 4, 3), (256, 8, 2), (128, 4, 1))
]
DRY_TILES = [dict(BLOCK_N=16, num_warps=4, num_stages=1)]


class Shape:
    """One (B, ctx): q, block table, the reference output and the byte count."""

    def __init__(self, p, cache, batch, ctx, gen, sms, mixed: str = ""):
        """mixed "random" / "sorted": lengths U[ctx / 8, ctx] (as an engine's batch has), in random order or
        longest first (the order the GPU starts the programs in); "" every sequence ctx tokens."""
        device = cache.kv.device
        self.batch, self.ctx, self.mixed = batch, ctx, mixed
        self.table = cache.tables(batch, ctx, gen)
        lens = torch.full((batch,), ctx, dtype=torch.int32)
        if mixed:
            same = torch.Generator().manual_seed(batch * 100_003 + ctx)  # random and sorted: the same lengths
            lens = torch.randint(ctx // 8, ctx + 1, (batch,), generator=same, dtype=torch.int32)
            if mixed == "sorted":
                lens = lens.sort(descending=True).values
        self.seq_lens = lens.to(device)
        self.q = torch.randn(batch, p["num_q_heads"], p["head_dim"], generator=gen).to(device, torch.bfloat16)
        self.splits = choose_num_splits(batch, p["num_kv_heads"], self.table.shape[1] * p["block_size"], sms)
        self.fp8_bytes = 2 * int(lens.sum()) * p["num_kv_heads"] * p["head_dim"]
        self.ref = None

    @property
    def name(self) -> str:
        return f"({self.batch}, {self.ctx}{' ' + self.mixed if self.mixed else ''})"


def run_config(shape, k_cache, v_cache, scale, config, num_splits=None):
    return paged_decode_attention_triton(
        shape.q, k_cache, v_cache, shape.table, shape.seq_lens, scale, num_splits=num_splits, config=config
    )


def measure(shape, k8, v8, scale, config, copy_bw, num_splits=None, timer=time_ms) -> dict:
    """Error against the reference and time of one config at one shape (an exception is recorded, not raised)."""
    row = dict(shape=shape.name, **{k: v for k, v in config.items()}, num_splits=num_splits or shape.splits)
    try:
        out = run_config(shape, k8, v8, scale, config, num_splits)
        err = (out.float() - shape.ref.float()).abs().max().item()
        ms = timer(lambda: run_config(shape, k8, v8, scale, config, num_splits))
    except Exception as exc:  # a tile that does not compile or fit (shared memory, registers): record why
        row.update(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        return row
    scale_ref = shape.ref.float().abs().max().item()
    row.update(ms=ms, pct_copy=100 * shape.fp8_bytes / (ms * 1e-3) / copy_bw, max_abs_err=err)
    row.update(rel_err=err / scale_ref, ok=err <= TOL_REL * scale_ref)
    return row


def label(row) -> str:
    parts = [row.get("VARIANT", "bf16")]
    if "BLOCK_N" in row:  # the Triton kernels' tiles (the mma kernel has its own: 32 tokens a warp)
        parts.append(f"N{row['BLOCK_N']} w{row['num_warps']} s{row['num_stages']}")
    for key, fmt in (
        ("CONV", "conv{}"),
        ("HEADS_FIRST", "hf"),
        ("BLOCK_G", "G{}"),
        ("PREFETCH", "prefetch"),
        ("HEADS_PER_PROGRAM", "hpp{}"),
        ("WARPS", "w{}"),
        ("MIN_BLOCKS", "b{}"),
        ("HEADS", "h{}"),
        ("SEQS", "s{}"),
    ):
        if row.get(key):
            parts.append(fmt.format(row[key]))
    if row.get("split_sweep"):
        parts.append(f"S{row['num_splits']}")
    return " ".join(parts)


class Sweep:
    """All measurements of one run, with the time budget."""

    def __init__(self, shapes, k8, v8, scale, copy_bw, budget_s, json_path, timer=time_ms):
        self.shapes, self.k8, self.v8, self.scale, self.copy_bw = shapes, k8, v8, scale, copy_bw
        self.timer = timer
        self.json_path = json_path
        self.deadline = time.monotonic() + budget_s
        self.rows, self.skipped = [], []

    def config(self, config, shapes=None, num_splits=None, tag=None) -> list[dict]:
        if time.monotonic() > self.deadline:
            self.skipped.append(dict(config, tag=tag))
            return []
        rows = []
        for shape in shapes or self.shapes:
            row = measure(shape, self.k8, self.v8, self.scale, config, self.copy_bw, num_splits, self.timer)
            row.update(tag=tag, split_sweep=num_splits is not None)
            rows.append(row)
            self.rows.append(row)
        with open(self.json_path, "w") as f:  # so far, in case the run is cut short; main() rewrites it whole
            json.dump(dict(partial=True, rows=self.rows), f, indent=1, default=str)
        cells = [
            f"{r['ms']:.4f} ({r['pct_copy']:.0f}%{'' if r['ok'] else ' ERR'})" if "ms" in r else "failed" for r in rows
        ]
        print(f"  {label(rows[0]):40s} " + " | ".join(cells), flush=True)
        for r in rows:
            if "error" in r:
                print(f"    {r['shape']}: {r['error']}", flush=True)
        return rows


def total_ms(rows) -> float:
    return sum(r["ms"] for r in rows) if rows and all("ms" in r and r["ok"] for r in rows) else float("inf")


def sweep_variants(sweep: Sweep, tiles, dry: bool) -> dict:
    """Phase 1: the tiles (outer) for each variant (inner; tokens_qk8, one e4m3 q, at the first tile only);
    phase 2: toggles on each variant's best tile; the mma kernel's warp counts (where it runs); then split counts.
    -> the best config per variant."""
    best = {}

    def consider(variant, config, rows):
        if total_ms(rows) < best.get(variant, (float("inf"), None))[0]:
            best[variant] = (total_ms(rows), config)

    for i, tile in enumerate(tiles):
        print(f"tile {label(dict(tile, VARIANT='*'))}:", flush=True)
        for variant in VARIANTS if i == 0 else [v for v in VARIANTS if v != "tokens_qk8"]:
            config = dict(tile, VARIANT=variant)
            consider(variant, config, sweep.config(config, tag="tile"))
    for variant, (_, base) in list(best.items()):
        toggles = [dict(CONV=1), dict(HEADS_FIRST=True)] + ([dict(BLOCK_G=8)] if variant.startswith("tokens") else [])
        if variant in ("rows", "tokens"):  # words prefetched into registers: 8 warps (4 spill at 128 tokens)
            toggles.append(dict(PREFETCH=True, num_warps=8, num_stages=1))
        if variant == "rows":  # several KV heads a program: HPP x 128-byte runs of a token, fuller dots
            toggles += [heads_per_program(base, n) for n in (2, 4, 8)]
        print(f"toggles on {label(base)}:", flush=True)
        for toggle in toggles if variant != "tokens_qk8" else []:
            consider(variant, dict(base, **toggle), sweep.config(dict(base, **toggle), tag="toggle"))
    if fp8_mma.available():  # the CUDA kernel: its default (warps from the work), then each warp count forced
        print("mma:", flush=True)
        for options in ({}, dict(WARPS=1), dict(WARPS=2), dict(WARPS=4), dict(AHEAD=0)):
            config = dict(options, VARIANT="mma")
            consider("mma", config, sweep.config(config, tag="mma"))
    split_shapes = [s for s in sweep.shapes if s.splits > 1]
    for variant in ("tokens", "rows") if split_shapes else ():
        if variant in best:
            for splits in (4, 8, 32) if not dry else (4,):
                sweep.config(best[variant][1], shapes=split_shapes, num_splits=splits, tag="splits")
    return {v: cfg for v, (_, cfg) in best.items()}


def summary(sweep: Sweep, baselines: dict) -> list[dict]:
    """Per shape: the bf16 kernel, the upcast default, and each variant's fastest correct config there."""
    out = []
    for shape in sweep.shapes:
        entry = dict(shape=shape.name, fp8_bytes=shape.fp8_bytes, **baselines[shape.name])
        for variant in VARIANTS + ["mma"]:
            rows = [r for r in sweep.rows if r["shape"] == shape.name and r.get("VARIANT") == variant and r.get("ok")]
            if rows:
                fastest = min(rows, key=lambda r: r["ms"])
                entry[variant] = dict(
                    ms=fastest["ms"], pct_copy=fastest["pct_copy"], config=label(fastest), err=fastest["max_abs_err"]
                )
        out.append(entry)
    return out


def print_summary(table, copy_gbps) -> None:
    print(f"\ncopy rate: {copy_gbps:.0f} GB/s (read + write); % copy = bytes read / time against it")
    print("\n| (B, ctx) | kernel | ms | % copy | config | max abs err vs bf16 kernel |")
    print("|---|---|---|---|---|---|")
    for e in table:
        bf = e["bf16"]
        print(f"| {e['shape']} | bf16 (bf16 cache) | {bf['ms']:.4f} | {bf['pct_copy']:.1f} | default | |")
        named = [("fp8 upcast (the default until 2026-12-02)", e["upcast"])]
        for name, v in named + [(f"fp8 {k}", e[k]) for k in VARIANTS + ["mma"] if k in e]:
            cells = f"{v['ms']:.4f} | {v['pct_copy']:.1f} | {v['config']} | {v['err']:.1e}"
            print(f"| {e['shape']} | {name} | {cells} |")


def baseline_rows(sweep: Sweep, cache, scale, p) -> dict:
    """The bf16 kernel over the bf16 cache and the upcast fp8 kernel at its default tile, per shape."""
    out = {}
    for shape in sweep.shapes:
        run = lambda: paged_decode_attention_triton(  # noqa: E731
            shape.q, cache.k_cache, cache.v_cache, shape.table, shape.seq_lens, scale
        )
        ms = sweep.timer(run)
        bf16 = dict(ms=ms, pct_copy=100 * 2 * shape.fp8_bytes / (ms * 1e-3) / sweep.copy_bw)
        on_cpu = shape.q.device.type == "cpu"
        # the upcast kernel at its own tile (decode_config's choice for an fp8 cache whose variants cannot run)
        default = decode_config(p["head_dim"], torch.bfloat16, on_cpu, FP8) if on_cpu else FP8_UPCAST_TILE
        rows = sweep.config(dict(default, VARIANT="upcast"), shapes=[shape], tag="default")
        r = rows[0]
        upcast = dict(
            ms=r.get("ms", float("nan")),
            pct_copy=r.get("pct_copy", float("nan")),
            config=label(r),
            err=r.get("max_abs_err", float("nan")),
        )
        out[shape.name] = dict(bf16=bf16, upcast=upcast)
    return out


def heads_per_program(config: dict, hpp: int) -> dict:
    """`config` reading `hpp` KV heads a program, its token tile cut by as much (at least 8 tokens), so that the
    tile's rows (tokens x heads) and registers stay about the same."""
    return dict(config, HEADS_PER_PROGRAM=hpp, HEADS_FIRST=True, BLOCK_N=max(8, config["BLOCK_N"] // hpp))


def split_sweep(sweep: Sweep, config: dict) -> int:
    """decode_config's fp8 default at every shape and split count (each split at least 64 tokens), the table last."""
    rows, heads = [], []
    for shape in sweep.shapes:
        for splits in (1, 2, 4, 8, 16, 32, 64):
            if shape.ctx // splits >= 64:
                rows += sweep.config(config, shapes=[shape], num_splits=splits, tag="split")
        if config.get("VARIANT") == "rows":  # several KV heads a program, at the heuristic's split and twice it
            for hpp in (2, 4, 8):
                for splits in (shape.splits, 2 * shape.splits):
                    hpp_config = heads_per_program(config, hpp)
                    heads += sweep.config(hpp_config, shapes=[shape], num_splits=splits, tag="hpp")
    with open(sweep.json_path, "w") as f:
        json.dump(dict(config=config, copy_gbps=sweep.copy_bw / 1e9, rows=rows + heads), f, indent=1, default=str)
    print(f"\n{label(dict(config, VARIANT=config.get('VARIANT', 'upcast')))}: ms (% of copy) by split count")
    print("| (B, ctx) | heuristic | " + " | ".join(f"S{n}" for n in (1, 2, 4, 8, 16, 32, 64)) + " |")
    print("|---|---|" + "---|" * 7)
    for shape in sweep.shapes:
        got = {r["num_splits"]: r for r in rows if r["shape"] == shape.name and "ms" in r}
        cells = [
            f"{got[n]['ms']:.4f} ({got[n]['pct_copy']:.0f}%)" if n in got else "-" for n in (1, 2, 4, 8, 16, 32, 64)
        ]
        print(f"| {shape.name} | S{shape.splits} | " + " | ".join(cells) + " |")
    if heads:
        print("\nHEADS_PER_PROGRAM (rows): ms (% of copy)")
        for r in heads:
            cell = f"{r['ms']:.4f} ({r['pct_copy']:.0f}%{'' if r['ok'] else ' ERR'})" if "ms" in r else r.get("error")
            print(f"| {r['shape']} | hpp{r['HEADS_PER_PROGRAM']} S{r['num_splits']} | {cell} |")
    return 0


def load_configs(text: str) -> dict:
    """--configs: {variant or "variant/tag": config}, a JSON string or a file holding one."""
    return json.load(open(text)) if os.path.exists(text) else json.loads(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "fp8_attention.json"))
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, one tile (CPU: TRITON_INTERPRET=1)")
    parser.add_argument("--budget-s", type=float, default=200.0, help="stop starting new configs after this")
    parser.add_argument("--table-from", metavar="JSON", help="print the table of a finished run's JSON and exit")
    parser.add_argument(
        "--configs",
        metavar="JSON",
        help="confirm run: time only these configs ({variant: config}, as a run prints after 'best config per "
        "variant'; a JSON string or file) beside the baselines, no sweep",
    )
    parser.add_argument(
        "--split-sweep",
        action="store_true",
        help="only time decode_config's fp8 default at every shape over split counts 1-64 (the split heuristic was "
        "tuned on bf16 caches, whose programs move twice the bytes of an fp8 one's)",
    )
    parser.add_argument(
        "--head-major",
        action="store_true",
        help="the fp8 cache with each block's heads stored one after another ((block, head, token, dim): a head's 16 "
        "tokens are one 2 KiB run) instead of the engine's (block, token, head, dim) (128-byte runs at fp8): whether "
        "DRAM locality is what holds the fp8 kernels back; the kernels read either through strides",
    )
    parser.add_argument(
        "--cudagraph",
        action="store_true",
        help="time every kernel replayed from a CUDA graph (the device's time; the engine replays decode steps from "
        "graphs) instead of launched from Python, whose host cost can exceed a 0.1 ms kernel's",
    )
    parser.add_argument(
        "--mixed",
        action="store_true",
        help="also the first two shapes with lengths U[ctx / 8, ctx] (an engine's batch), in random order and sorted "
        "longest first: what uneven programs cost, and whether starting the longest first wins it back",
    )
    parser.add_argument(
        "--probe",
        type=int,
        default=0,
        metavar="N",
        help="run the bf16 kernel and the fp8 default N times per shape, untimed, and exit (for ncu)",
    )
    args = parser.parse_args(argv)
    if args.table_from:
        with open(args.table_from) as f:
            done = json.load(f)
        if "summary" not in done:
            sys.exit(f"{args.table_from}: the run did not finish ({len(done.get('rows', []))} measurements)")
        print_summary(done["summary"], done["copy_gbps"])
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("no GPU: run the dry run under the interpreter, TRITON_INTERPRET=1 ... --dry-run")
    p, tiles = (DRY, DRY_TILES) if args.dry_run or device == "cpu" else (FULL, TILES)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    copy_bw = copy_bandwidth(device, (2 << 30) if device == "cuda" else (1 << 20))
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4
    cache = PagedCache(p, device, torch.bfloat16)
    kv8 = cache.kv.to(FP8)
    k8, v8 = kv8[:, 1, 0], kv8[:, 1, 1]
    if args.head_major:  # the same values, (N, L, 2, Hkv, bs, D) in memory, read as (N, bs, Hkv, D) views
        head_major = kv8.permute(0, 1, 2, 4, 3, 5).contiguous()
        k8, v8 = head_major[:, 1, 0].transpose(1, 2), head_major[:, 1, 1].transpose(1, 2)
    kv_up = kv8.to(torch.bfloat16)  # the e4m3 values in bf16: what the bf16 kernel reads for the reference
    scale = p["head_dim"] ** -0.5
    shapes = [Shape(p, cache, b, ctx, gen, sms) for b, ctx in p["shapes"]]
    if args.mixed:  # lengths U[ctx / 8, ctx], random order and longest first, at two of the shapes
        shapes += [Shape(p, cache, b, ctx, gen, sms, m) for b, ctx in p["shapes"][:2] for m in ("random", "sorted")]
    for shape in shapes:
        shape.ref = paged_decode_attention_triton(
            shape.q, kv_up[:, 1, 0], kv_up[:, 1, 1], shape.table, shape.seq_lens, scale
        )
    del kv_up
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    timer = time_graph_ms if args.cudagraph and device == "cuda" else time_ms
    sweep = Sweep(shapes, k8, v8, scale, copy_bw, args.budget_s, args.json, timer)
    print(f"shapes {[s.name for s in shapes]} (splits {[s.splits for s in shapes]}); ms (% copy) per shape", flush=True)
    default = decode_config(p["head_dim"], torch.bfloat16, device == "cpu", FP8)
    if args.configs and (args.probe or args.split_sweep):  # probe or sweep the first config given, not the default
        name, config = next(iter(load_configs(args.configs).items()))
        default = dict(config, VARIANT=name.split("/")[0])
    if args.probe:
        for shape in shapes:
            for _ in range(args.probe):
                paged_decode_attention_triton(shape.q, cache.k_cache, cache.v_cache, shape.table, shape.seq_lens, scale)
                run_config(shape, k8, v8, scale, default)
        torch.cuda.synchronize() if device == "cuda" else None
        print(f"probe: {args.probe} launches of the bf16 kernel and the fp8 default {default} per shape")
        return 0
    if args.split_sweep:
        return split_sweep(sweep, default)
    baselines = baseline_rows(sweep, cache, scale, p)
    if args.configs:
        given = load_configs(args.configs)
        for variant, config in given.items():
            print(f"{variant}:", flush=True)
            sweep.config(dict(config, VARIANT=variant.split("/")[0]), tag="confirm")
        best = given
    else:
        best = sweep_variants(sweep, tiles, dry=p is DRY)
    table = summary(sweep, baselines)
    result = dict(
        device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        torch=torch.__version__,
        triton=__import__("triton").__version__,
        params=p,
        copy_gbps=copy_bw / 1e9,
        rows=sweep.rows,
        skipped=sweep.skipped,
        best_config=best,
        summary=table,
    )
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    if sweep.skipped:
        print(f"\nbudget reached: {len(sweep.skipped)} configs not run (listed in the JSON)")
    print(f"\nbest config per variant (least total ms, all shapes correct): {json.dumps(best)}")
    print_summary(table, copy_bw / 1e9)
    return 0


if __name__ == "__main__":
    sys.exit(main())
