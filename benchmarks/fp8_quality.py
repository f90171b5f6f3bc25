"""FP8 quality on the default model: held-out perplexity and greedy tokens, bf16 beside fp8.

    python benchmarks/fp8_quality.py --device cuda --json out.json     # on a GPU
    python benchmarks/fp8_quality.py --device cpu --num-windows 8      # the same variants through the CPU paths

The baseline is the first variant (default: the model in bfloat16); every variant runs
in bfloat16 on either device. `fp8 w+kv` / `fp8 w8a8+kv` is --quantization fp8 with --kv-cache-dtype fp8 as
the engine runs it by default (splitserve.engine.worker.fp8: every step's activations quantized per token, W8A8);
`fp8 w8a16+kv` adds --fp8-w8a16-max-rows 16: steps of up to 16 rows keep activations in bf16 (W8A16; on a
GPU the fp8_skinny_linear kernel, on a CPU its reference: the greedy decode of 16 prompts is W8A16, the
512-token windows and the batched prompts W8A8).

Perplexity: windows of --window tokens of tests/data/heldout.txt (the default model's held-out
slice), each run as one prefill whose keys and values go through the KV cache (an fp8 cache's
attention reads the quantized keys), scored on every next token. Greedy: --num-prompts prompts
(the held-out text's first lines of at least 24 characters), --max-tokens tokens each, through `LLM`,
with the baseline's top-2 logprobs: where a variant's tokens first differ, the baseline's margin
between its first and second choice says how near a tie the flipped token was.
Goals: perplexity within 3% of bf16, greedy tokens equal for >= 12 of 16 prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
HELDOUT = REPO / "tests" / "data" / "heldout.txt"
BF16 = {"dtype": "bfloat16"}
FP8 = {**BF16, "quantization": "fp8", "kv_cache_dtype": "fp8"}
# name -> engine options
VARIANTS = {
    "bf16": BF16,
    "fp8 kv": {**BF16, "kv_cache_dtype": "fp8"},
    "fp8 w+kv": FP8,
    "fp8 w8a16+kv": {**FP8, "fp8_w8a16_max_rows": 16},
    "fp8 w8a8+kv": {**FP8, "fp8_w8a16_max_rows": 0},
    "fp8 w": {**BF16, "quantization": "fp8"},
    "float32": {"dtype": "float32"},  # not run by default: how far 16-bit alone moves a float32 model
    # not run by default: bf16 with each prompt in a batch of its own (prefill and decode of one row), how far the
    # batch's shape alone moves bf16's greedy tokens (the matmuls' reduction order changes with the row count)
    "bf16 alone": {**BF16, "max_num_seqs": 1},
}
DEFAULT_VARIANTS = "bf16,fp8 kv,fp8 w8a16+kv,fp8 w8a8+kv"


def window_nll(engine, ids: list[int]) -> tuple[float, int]:
    """Summed next-token negative log-likelihood of one window, run as one prefill through the KV cache."""
    from splitserve.engine.worker.attention import AttentionMetadata

    device = engine.runner.device
    n = len(ids)
    block_size = engine.config.block_size
    num_blocks = -(-n // block_size)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :],
        slot_mapping=torch.arange(n, dtype=torch.int64, device=device),
        max_query_len=n,
        max_seq_len=n,
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
    )
    tokens = torch.tensor(ids, device=device)
    with torch.no_grad():
        hidden = engine.runner.model(tokens, torch.arange(n, device=device), engine.runner.kv_cache, meta)
        logits = engine.runner.model.compute_logits(hidden[:-1]).float()  # (n-1, V)
    nll = torch.nn.functional.cross_entropy(logits, tokens[1:], reduction="sum")
    return float(nll), n - 1


def evaluate(variant: dict, args, windows: list[list[int]], prompts: list[list[int]]) -> dict:
    from splitserve.engine import LLM, SamplingParams

    start = time.perf_counter()
    engine_args = {"max_num_seqs": args.num_prompts, "enforce_eager": True, **variant}
    llm = LLM(device=args.device, num_kv_blocks=-(-args.window // 16) + 64, **engine_args)
    total, count = 0.0, 0
    for ids in windows:
        nll, n = window_nll(llm.engine, ids)
        total, count = total + nll, count + n
    params = [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=2) for _ in prompts]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return {
        "perplexity": math.exp(total / count),
        "scored_tokens": count,
        "greedy": [o.token_ids for o in outs],
        # per prompt and position: top-1 minus top-2 logprob (how clear each greedy choice was)
        "margins": [[lp.top[0][1] - lp.top[1][1] for lp in o.logprobs] for o in outs],
        "kv_layout": llm.engine.layout.describe(),
        "seconds": time.perf_counter() - start,
    }


def common_prefix(a: list[int], b: list[int]) -> int:
    """Leading tokens two outputs share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def compare(results: dict, base_name: str, args, num_prompts: int, num_windows: int) -> None:
    """Each variant against the baseline: perplexity ratio, prompts equal, and at each first difference
    the baseline's margin between its top two tokens (stored in `results`, then printed as a table)."""
    base = results[base_name]
    all_margins = sorted(m for row in base["margins"] for m in row)
    for r in results.values():
        pairs = list(zip(r["greedy"], base["greedy"]))
        firsts = [(i, common_prefix(a, b)) for i, (a, b) in enumerate(pairs) if a != b]
        r["baseline"] = base_name
        r["prompts_equal"] = len(pairs) - len(firsts)
        r["mean_common_prefix"] = sum(common_prefix(a, b) for a, b in pairs) / len(pairs)
        r["ppl_ratio"] = r["perplexity"] / base["perplexity"]
        r["first_differences"] = [
            {"prompt": i, "position": p, "base_margin": base["margins"][i][p], "variant_margin": r["margins"][i][p]}
            for i, p in firsts
        ]
        # a margin's place among all the baseline's choices: 0.05 = only 5% of them were closer calls
        for d in r["first_differences"]:
            d["base_margin_quantile"] = sum(m < d["base_margin"] for m in all_margins) / len(all_margins)
    print(
        f"\ndefault model, {args.device}: {num_windows} windows of {args.window} tokens; greedy {args.max_tokens} "
        f"tokens of {num_prompts} prompts; baseline {base_name}; its top-1 - top-2 logprob margin over all "
        f"{len(all_margins)} greedy positions: median {statistics.median(all_margins):.2f}, "
        f"10th percentile {all_margins[len(all_margins) // 10]:.3f}"
    )
    print("\n".join(quality_table(results)))


def quality_table(results: dict) -> list[str]:
    """The table's lines (markdown) from compare()'s fields."""
    base_name = next(iter(results.values()))["baseline"]
    lines = [
        f"| variant | perplexity | vs {base_name} | greedy prompts equal | mean equal tokens before a difference "
        f"| {base_name} margin at each first difference (its quantile) | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        diffs = " ".join(f"{d['base_margin']:.3f} ({d['base_margin_quantile']:.2f})" for d in r["first_differences"])
        lines.append(
            f"| {name} | {r['perplexity']:.4f} | {100 * (r['ppl_ratio'] - 1):+.2f}% | "
            f"{r['prompts_equal']}/{len(r['greedy'])} | {r['mean_common_prefix']:.1f} | {diffs or '-'} | "
            f"{r['seconds']:.1f} |"
        )
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--num-windows", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    from splitserve.common.config import default_model_dir
    from splitserve.common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir())
    text = HELDOUT.read_text()
    ids = tokenizer.encode(text)
    windows = [ids[i : i + args.window] for i in range(0, args.num_windows * args.window, args.window)]
    windows = [w for w in windows if len(w) == args.window]
    lines = [line for line in text.splitlines() if len(line.strip()) >= 24]
    step = max(1, len(lines) // args.num_prompts)
    prompts = [tokenizer.encode(lines[i * step]) for i in range(args.num_prompts)]
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    results = {name: evaluate(VARIANTS[name], args, windows, prompts) for name in names}
    compare(results, names[0], args, len(prompts), len(windows))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
