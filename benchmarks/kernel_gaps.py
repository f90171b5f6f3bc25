"""Kernel gaps against their ceilings in one device call, each against its baseline in the same process
(CUDA only):

    prefill   causal 1 x 8192 and 16 x 512: SDPA, the paged kernel (cached prefixes, chunks, mixed steps),
              the fresh-prompt kernel (TMA over the step's own k/v) with its default tiles and a tile /
              warp-specialisation sweep
    decode    paged decode attention vs SDPA (kernel_timings.py's shapes)
    step      Llama-3-8B-shaped dummy bf16 model: engine decode-step wall (prompt 512, batch 1 / 16 / 128)
              and the graph replay, unfused ops vs fused, alternating, graphs recaptured for each; plus the
              fused graph's hidden states against the unfused one's on the same inputs

    python benchmarks/kernel_gaps.py --json $OUT/gaps.json [--sections prefill,decode,step]

Every section prints as it ends; the summary table is printed last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from kernel_timings import FULL, PagedCache, bench_decode, copy_bandwidth, time_ms

PREFILL_SHAPES = [(1, 8192), (16, 512)]
FRESH_SWEEP = [
    dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s, WARP_SPEC=ws)
    for m, n, w, s, ws in [
        (128, 64, 4, 3, False),
        (128, 64, 8, 3, False),
        (128, 128, 8, 2, False),
        (128, 128, 8, 3, False),
        (64, 64, 4, 3, False),
        (128, 64, 4, 2, True),
        (128, 128, 8, 2, True),
        (64, 64, 4, 2, True),
    ]
]


def _guarded(fn):
    """fn() or the error's first line (a config may not compile or fit on this chip)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def bench_prefill(cache, dtype, gen, sweep_configs) -> list[dict]:
    from splitserve.kernels.fresh_prefill_attention import fresh_prefill_attention
    from splitserve.kernels.paged_prefill_attention import paged_prefill_attention_triton

    hq, hkv, d = FULL["num_q_heads"], FULL["num_kv_heads"], FULL["head_dim"]
    scale, rows = d**-0.5, []
    for batch, length in PREFILL_SHAPES:
        total = batch * length
        table = cache.tables(batch, length, gen)
        seq_lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        qsl = (torch.arange(batch + 1, dtype=torch.int32) * length).cuda()
        qkv = torch.randn(total, (hq + 2 * hkv) * d, device="cuda", dtype=dtype)  # the projection's layout
        q = qkv[:, : hq * d].view(total, hq, d)
        k_dense, v_dense = cache.dense(table)  # (B, Hkv, L, D): the paged cache's contents
        k = qkv[:, hq * d : (hq + hkv) * d].view(total, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(total, hkv, d)
        k.copy_(k_dense.transpose(1, 2).reshape(total, hkv, d))  # same keys for every kernel
        v.copy_(v_dense.transpose(1, 2).reshape(total, hkv, d))
        qd = q.reshape(batch, length, hq, d).transpose(1, 2)  # (B, Hq, L, D)

        def sdpa(qd=qd, k_dense=k_dense, v_dense=v_dense):
            return F.scaled_dot_product_attention(qd, k_dense, v_dense, scale=scale, is_causal=True, enable_gqa=True)

        ref = sdpa().transpose(1, 2).reshape(total, hq, d).float()

        def paged(q=q, table=table, qsl=qsl, seq_lens=seq_lens, length=length):
            return paged_prefill_attention_triton(q, cache.k_cache, cache.v_cache, table, qsl, seq_lens, length, scale)

        flops = 4 * batch * hq * d * length * length / 2
        row = dict(batch=batch, length=length, sdpa_ms=time_ms(sdpa), paged_ms=time_ms(paged))
        row["paged_err"] = (paged().float() - ref).abs().max().item()
        fresh = lambda cfg=None: fresh_prefill_attention(q, k, v, qsl, length, scale, config=cfg)  # noqa: E731
        row["fresh_ms"] = time_ms(fresh)
        row["fresh_err"] = (fresh().float() - ref).abs().max().item()
        sweep = []
        for cfg in sweep_configs:
            ms = _guarded(lambda: time_ms(lambda: fresh(cfg)))
            err = _guarded(lambda: (fresh(cfg).float() - ref).abs().max().item()) if isinstance(ms, float) else None
            sweep.append(dict(cfg, ms=ms, err=err))
            print(f"  prefill {batch}x{length} fresh {cfg}: {ms} err {err}", flush=True)
        row["fresh_sweep"] = sweep
        for key in ("sdpa", "paged", "fresh"):
            row[f"{key}_tflops"] = flops / row[f"{key}_ms"] / 1e9
        row["paged_pct_sdpa"] = 100 * row["sdpa_ms"] / row["paged_ms"]
        row["fresh_pct_sdpa"] = 100 * row["sdpa_ms"] / row["fresh_ms"]
        good = [s for s in sweep if isinstance(s["ms"], float) and s["err"] is not None and s["err"] < 0.05]
        if good:
            best = min(good, key=lambda s: s["ms"])
            row["best"] = best
            row["best_pct_sdpa"] = 100 * row["sdpa_ms"] / best["ms"]
        rows.append(row)
        print({k: v for k, v in row.items() if k != "fresh_sweep"}, flush=True)
    return rows


def _graph_ms(llm, batch: int, context: int, vocab: int) -> float:
    from decode_profile import _event_ms, _fill_graph_inputs

    bucket = _fill_graph_inputs(llm.engine.runner, batch, context, vocab)
    return _event_ms(llm.engine.runner.graphs.graphs[bucket].replay, repeats=50)


MODES = {"unfused": False, "fused": True}  # name -> model.fused_ops


def _capture(llm, mode: str, max_num_seqs: int, max_model_len: int) -> None:
    runner = llm.engine.runner
    runner.model.fused_ops = MODES[mode]
    runner.graphs = None
    torch.cuda.synchronize()
    runner.capture_graphs(max_num_seqs, max_model_len)


def _hidden_diff(llm, max_num_seqs: int, max_model_len: int, batch: int, vocab: int) -> dict:
    """One replay of the unfused and the fused graph on the same static inputs (no KV write)."""
    from decode_profile import _fill_graph_inputs

    out = {}
    for fused in (False, True):
        _capture(llm, "fused" if fused else "unfused", max_num_seqs, max_model_len)
        torch.manual_seed(5)
        bucket = _fill_graph_inputs(llm.engine.runner, batch, 576, vocab)
        llm.engine.runner.graphs.graphs[bucket].replay()
        torch.cuda.synchronize()
        out[fused] = llm.engine.runner.graphs.outputs[bucket][:batch].float().clone()
    diff = (out[True] - out[False]).abs()
    return dict(
        batch=batch,
        max_abs=diff.max().item(),
        rel_norm=(diff.norm() / out[False].norm()).item(),
        argmax_equal=bool(
            (
                llm.engine.runner.model.compute_logits(out[True].to(torch.bfloat16)).argmax(-1)
                == llm.engine.runner.model.compute_logits(out[False].to(torch.bfloat16)).argmax(-1)
            ).all()
        ),
    )


def _prefill_diff(llm, vocab: int) -> dict:
    """An eager step of two fresh prompts (300 and 45 tokens): unfused (paged prefill kernel) vs fused
    (rotary+KV write, fresh-prompt attention); hidden states of every token."""
    from splitserve.engine.worker.attention import AttentionMetadata

    runner = llm.engine.runner
    lens, block = [300, 45], runner.block_size
    ids = torch.randint(10, vocab, (sum(lens),), device="cuda")
    positions = torch.cat([torch.arange(n) for n in lens]).cuda()
    tables = torch.zeros(2, 32, dtype=torch.int32)
    tables[0, :19] = torch.arange(100, 119)
    tables[1, :3] = torch.arange(200, 203)
    slots = torch.cat(
        [tables[i, torch.arange(n) // block].long() * block + torch.arange(n) % block for i, n in enumerate(lens)]
    )
    qsl = [0, lens[0], sum(lens)]
    out = {}
    for fused in (False, True):
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device="cuda"),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
            block_tables=tables.cuda(),
            slot_mapping=slots.cuda(),
            max_query_len=max(lens),
            max_seq_len=max(lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=lens,
        )
        runner.model.fused_ops = fused
        with torch.inference_mode():
            out[fused] = runner.model(ids, positions, runner.kv_cache, meta).float()
    diff = (out[True] - out[False]).abs()
    return dict(max_abs=diff.max().item(), rel_norm=(diff.norm() / out[False].norm()).item())


def bench_step(config_path: str, batches: list[int], rounds: int) -> dict:
    from offline_throughput import fixed_splitserve

    from splitserve.engine import LLM

    vocab = json.loads(Path(config_path).read_text())["vocab_size"]
    max_num_seqs, max_model_len = max(batches), 1024
    llm = LLM(
        model=config_path,
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=2048,
        max_model_len=max_model_len,
        kv_cache_memory_fraction=0.5,
    )
    llm.engine.runner.kv_cache.uniform_(-1, 1)  # allocated uninitialised: the checks read blocks nobody wrote
    result = dict(checks=[_hidden_diff(llm, max_num_seqs, max_model_len, b, vocab) for b in (1, 16)])
    result["prefill_check"] = _prefill_diff(llm, vocab)
    print(result, flush=True)
    runs = []
    for r in range(rounds):
        for mode in MODES:  # alternating, graphs recaptured for each
            start = time.perf_counter()
            _capture(llm, mode, max_num_seqs, max_model_len)
            capture_s = time.perf_counter() - start
            fixed_splitserve(llm, 2, 32, 4, vocab, "cuda")  # warm-up
            for b in batches:
                row = fixed_splitserve(llm, b, 512, 64, vocab, "cuda")
                row.update(round=r, mode=mode, capture_s=capture_s, graph_ms=_graph_ms(llm, b, 544, vocab))
                runs.append(row)
                print(row, flush=True)
    result["runs"] = runs
    return result


def summary(r: dict) -> None:
    print("\n== summary ==")
    if "prefill" in r:
        print(
            "| prefill B x L | SDPA ms (TFLOP/s) | paged ms | % SDPA | fresh default ms | % SDPA "
            + "| best fresh cfg | ms | % SDPA | err |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for x in r["prefill"]:
            best = x.get("best", {})
            print(
                f"| {x['batch']} x {x['length']} | {x['sdpa_ms']:.3f} ({x['sdpa_tflops']:.0f}) | {x['paged_ms']:.3f} | "
                f"{x['paged_pct_sdpa']:.1f} | {x['fresh_ms']:.3f} | {x['fresh_pct_sdpa']:.1f} | "
                f"{ {k: best.get(k) for k in ('BLOCK_M', 'BLOCK_N', 'num_warps', 'num_stages', 'WARP_SPEC')} } | "
                f"{best.get('ms', float('nan')):.3f} | {x.get('best_pct_sdpa', float('nan')):.1f} | "
                f"{x['fresh_err']:.1e} |"
            )
    if "decode" in r:
        print("| decode (B, ctx) | ms | SDPA ms | % of SDPA rate |")
        print("|---|---|---|---|")
        for x in r["decode"]:
            print(f"| ({x['batch']}, {x['ctx']}) | {x['ms']:.4f} | {x['sdpa_ms']:.4f} | {x['pct_sdpa']:.1f} |")
    if "step" in r:
        print("| batch | mode | decode step ms (rounds) | graph ms (median) | prefill ms (rounds) |")
        print("|---|---|---|---|---|")
        runs = r["step"]["runs"]
        for b in sorted({x["batch"] for x in runs}):
            for mode in MODES:
                mine = [x for x in runs if x["batch"] == b and x["mode"] == mode]
                steps = " / ".join(f"{x['decode_step_ms']:.2f}" for x in mine)
                prefill = " / ".join(f"{x['prefill_ms']:.0f}" for x in mine)
                graph = statistics.median(x["graph_ms"] for x in mine)
                print(f"| {b} | {mode} | {steps} | {graph:.3f} | {prefill} |")
        print("fused vs unfused hidden states:", r["step"]["checks"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="")
    parser.add_argument("--sections", default="prefill,decode,step")

    parser.add_argument("--config", default=str(Path(__file__).parent / "configs" / "llama3-8b.json"))
    parser.add_argument("--batches", default="1,128")
    parser.add_argument("--sweep", action="store_true", help="also time the prefill tile sweep")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    dtype, gen = torch.bfloat16, torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    r: dict = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__)
    import triton

    r["triton"] = triton.__version__

    def save():
        if args.json:
            Path(args.json).write_text(json.dumps(r, indent=1, default=str))

    def section(name, fn):
        if name not in sections:
            return
        try:
            r[name] = fn()
        except Exception:  # noqa: BLE001 - report and go on to the next section
            import traceback

            traceback.print_exc()
            r[name + "_error"] = traceback.format_exc()[-2000:]
        save()

    if "prefill" in sections or "decode" in sections:
        cache = PagedCache(FULL, "cuda", dtype)
        section("prefill", lambda: bench_prefill(cache, dtype, gen, FRESH_SWEEP if args.sweep else []))
        section("decode", lambda: bench_decode(FULL, cache, copy_bandwidth("cuda", 2 << 30), "cuda", dtype, gen))
        del cache
        torch.cuda.empty_cache()
    section("step", lambda: bench_step(args.config, [int(b) for b in args.batches.split(",")], args.rounds))
    try:
        summary(r)
    except Exception:  # noqa: BLE001
        import traceback

        traceback.print_exc()
    return 0


if __name__ == "__main__":
    sys.exit(main())
