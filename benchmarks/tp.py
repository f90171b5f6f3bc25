"""Tensor parallelism: the decode step at TP 2 against TP 1, and the all-reduce's share of it.

    python benchmarks/tp.py --json $OUT/tp.json          (two GPUs: Llama-3-8B shape, dummy bf16 weights)
    python benchmarks/tp.py --smoke                      (CPU, gloo: a tiny model, to check the script)
    python benchmarks/tp.py --fp8-block --json $OUT/tp-fp8.json   (the same from a block-wise fp8 checkpoint)

Per TP size an offline engine (`EngineCore`, eager on both sizes: TP graphs are not built yet, so TP 1 also
runs eager for a like-for-like step; `--tp1-graphs` adds a TP 1 row with CUDA graphs) takes `batch`
requests of `--prompt-len` tokens, prefills them, then times `--steps` decode steps (wall time of
`EngineCore.step()`, which waits for its tokens). At TP 2 rank 0's all-reduces are timed inside the step
with CUDA events (on CPU, the wall clock): two per layer plus the embedding's, their time including any wait
for the other rank. A separate two-process loop times the same all-reduces alone (`allreduce_alone_ms`:
2 x layers + 1 all-reduces of a (batch, hidden) tensor), the collective's own cost without the skew.

`--fp8-block`: both sizes load a block-wise fp8 checkpoint of the --config model's random weights (128 x 128 tiles,
`weight_scale_inv`: fp8_block_linear.write_block_checkpoint, beside this script) instead of dummy bf16 weights, each
rank its shard of the e4m3 weights and tile scales; every step then runs the block-wise kernels on each rank's shapes,
and the rows also give how many of the greedy tokens TP 2 shares with TP 1 (`tokens_equal`: bf16 sums in another
order, so not all need to; with dummy weights, drawn per shard, the sizes' models differ and it is left out).

The table is printed last; `--json` keeps the rows.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import torch

from splitserve.common.config import EngineConfig
from splitserve.common.sampling_params import SamplingParams

HERE = Path(__file__).resolve().parent


def timed_all_reduce(group, events: list):
    """Wrap `group.all_reduce` so each call's time is kept: CUDA event pairs, or wall seconds on CPU."""
    inner = group.all_reduce

    def all_reduce(x):
        if x.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = inner(x)
            end.record()
            events.append((start, end))
            return out
        t0 = time.perf_counter()
        out = inner(x)
        events.append(time.perf_counter() - t0)
        return out

    group.all_reduce = all_reduce  # the model's layers hold this object: they call the wrapper


def _ms(events: list) -> float:
    if not events:
        return 0.0
    if isinstance(events[0], float):
        return 1e3 * sum(events)
    torch.cuda.synchronize()
    return sum(start.elapsed_time(end) for start, end in events)


def decode_steps(engine, batch: int, args) -> dict:
    """Prefill `batch` prompts, then time args.steps decode steps (after args.warmup); `tokens`: every request's
    greedy tokens, in request order."""
    params = SamplingParams(temperature=0, max_tokens=args.warmup + args.steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", [(7 * i + j) % 1000 + 10 for j in range(args.prompt_len)], params)
    tokens: dict[str, list[int]] = {}
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        _keep(engine.step(), tokens)
    for _ in range(args.warmup):
        _keep(engine.step(), tokens)
    events: list = []
    group = engine.tp_workers.group if engine.tp_workers is not None else None
    if group is not None:
        timed_all_reduce(group, events)
    times = []
    for _ in range(args.steps):
        if engine.runner.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        _keep(outs, tokens)
    reduce_ms = _ms(events) / args.steps
    if group is not None:
        del group.all_reduce  # the class's method again
    for request_id in list(engine.scheduler.requests):
        engine.abort(request_id)
    step_ms = 1e3 * statistics.median(times)
    ordered = [tokens.get(f"b{batch}-{i}", []) for i in range(batch)]
    return {"step_ms": round(step_ms, 3), "allreduce_in_step_ms": round(reduce_ms, 3), "tokens": ordered}


def _keep(outs, tokens: dict[str, list[int]]) -> None:
    for out in outs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)


def engine_for(args, size: int, graphs: bool):
    from splitserve.engine.engine_core import EngineCore

    config = EngineConfig(
        model=args.model,
        load_format="auto" if args.fp8_block else "dummy",
        dtype=args.dtype,
        device=args.device,
        tensor_parallel_size=size,
        enforce_eager=not graphs,
        async_scheduling=False,
        block_size=16,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=max(args.batches),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.prompt_len + args.warmup + args.steps + 16,
        enable_prefix_caching=False,
    )
    return EngineCore(config, offline=True)


def _allreduce_rank(rank: int, device: str, shapes: list, iters: int, dtype, port_q, result_q) -> None:
    """One of two ranks timing `calls` all-reduces of (batch, hidden) per shape; rank 0 reports ms per step."""
    from splitserve.engine.worker.tensor_parallel import TpGroup

    dev = torch.device(device if device == "cpu" else f"cuda:{rank}")
    listener = None
    if rank == 0:
        listener, port = TpGroup.listen()
        port_q.put(port)
    else:
        port = port_q.get()
    group = TpGroup(rank, 2, port, dev, listener)
    results = {}
    for batch, hidden, calls in shapes:
        x = torch.ones(batch, hidden, dtype=dtype, device=dev)
        for _ in range(3):
            group.all_reduce(x)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(iters):
            for _ in range(calls):
                group.all_reduce(x)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        results[batch] = 1e3 * (time.perf_counter() - t0) / iters
    if rank == 0:
        result_q.put(results)


def allreduce_alone(args, hidden: int, num_layers: int) -> dict[int, float]:
    """ms per step of 2 x layers + 1 all-reduces of (batch, hidden), two processes, nothing else running."""
    ctx = mp.get_context("spawn")
    port_q, result_q = ctx.Queue(), ctx.Queue()
    shapes = [(b, hidden, 2 * num_layers + 1) for b in args.batches]
    dtype = getattr(torch, args.dtype)
    procs = [
        ctx.Process(target=_allreduce_rank, args=(r, args.device, shapes, args.steps, dtype, port_q, result_q))
        for r in range(2)
    ]
    for proc in procs:
        proc.start()
    results = result_q.get(timeout=300)
    for proc in procs:
        proc.join(60)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(HERE / "configs" / "llama3-8b.json"))
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,64,128")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--num-kv-blocks", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--tp1-graphs", action="store_true", help="also TP 1 with CUDA graphs")
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, the tiny config: checks the script")
    ap.add_argument("--fp8-block", action="store_true", help="a block-wise fp8 checkpoint of --config's weights")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.smoke:
        args.config, args.device, args.dtype = str(HERE / "configs" / "llama-tiny-cpu.json"), "cpu", "float32"
        args.batches, args.prompt_len, args.warmup, args.steps, args.num_kv_blocks = "1,4", 16, 1, 3, 64
    args.batches = [int(b) for b in args.batches.split(",")]
    model = json.loads(Path(args.config).read_text())
    with tempfile.TemporaryDirectory() as directory:
        args.model = args.config
        if args.fp8_block:
            from fp8_block_linear import write_block_checkpoint

            args.model = write_block_checkpoint(args.config, directory, args.device)
        rows = run_sizes(args)
    alone = allreduce_alone(args, model["hidden_size"], model["num_hidden_layers"])
    first = {r["batch"]: r["tokens"] for r in rows if r["run"] == "tp1-eager"}
    for row in rows:
        row["allreduce_alone_ms"] = round(alone[row["batch"]], 3) if row["run"].startswith("tp2") else 0.0
        pairs = [(a, b) for want, got in zip(first[row["batch"]], row.pop("tokens")) for a, b in zip(want, got)]
        # dummy weights are drawn per rank's shard: the TP sizes' models differ, so their tokens tell nothing
        row["tokens_equal"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}" if args.fp8_block else "-"
    report(args, rows)


def run_sizes(args) -> list[dict]:
    """A row per (run, batch): TP 1 eager (and with graphs where asked), then TP 2."""
    runs = [("tp1-eager", 1, False), ("tp2-eager", 2, False)]
    if args.tp1_graphs and args.device != "cpu":
        runs.insert(1, ("tp1-graphs", 1, True))
    rows = []
    for name, size, graphs in runs:
        engine = engine_for(args, size, graphs)
        try:
            for batch in args.batches:
                rows.append({"run": name, "batch": batch, **decode_steps(engine, batch, args)})
                print({k: v for k, v in rows[-1].items() if k != "tokens"}, flush=True)
        finally:
            engine.close()
            del engine
    return rows


def report(args, rows: list[dict]) -> None:
    """The JSON (--json) and the table."""
    context = {"device": torch.cuda.get_device_name(0) if args.device != "cpu" else "cpu", "torch": torch.__version__}
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **context, "rows": rows}, indent=2))
    base = {r["batch"]: r["step_ms"] for r in rows if r["run"] == "tp1-eager"}
    weights = "block-wise fp8 checkpoint" if args.fp8_block else "dummy weights"
    shape = f"{Path(args.config).name}, {args.dtype}, {weights}, prompt {args.prompt_len}"
    print(f"\n{context['device']}, {shape}, median of {args.steps} steps")
    heads = ("step ms", "vs tp1", "allreduce in step ms", "share", "alone ms", "tokens = tp1")
    print(f"{'run':<11} {'batch':>5} " + " ".join(f"{h:>{w}}" for h, w in zip(heads, (9, 7, 21, 6, 9, 13))))
    for r in rows:
        share = r["allreduce_in_step_ms"] / r["step_ms"] if r["step_ms"] else 0.0
        print(
            f"{r['run']:<11} {r['batch']:>5} {r['step_ms']:>9.3f} {base[r['batch']] / r['step_ms']:>6.2f}x "
            f"{r['allreduce_in_step_ms']:>21.3f} {share:>6.1%} {r['allreduce_alone_ms']:>9.3f} {r['tokens_equal']:>13}"
        )


if __name__ == "__main__":
    main()
