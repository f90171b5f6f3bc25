"""Where one decode step's time goes (CUDA only): graph replay vs logits/sampling vs host.

A module, not a script: used by `python benchmarks/offline_throughput.py --workload fixed --profile` after each
batch's timed run, on the same engine (kernel_gaps.py's step section times its graph replays with it too). It
fills the decode graph's static buffers for `batch` sequences of `context` tokens (distinct blocks, no KV write)
and measures with CUDA events:

    graph_ms     one replay of the captured decode graph (every layer; no lm_head)
    logits_ms    lm_head over the batch's hidden states
    sample_ms    greedy sampling including the copy of the ids to the host (wall, synchronised)

then lists the graph's kernels (torch.profiler, mean device ms per replay) and the host functions
of a few real decode steps (cProfile, by own time). step wall - (graph + logits + sample) is host
work and launch gaps outside the graph.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import random
import statistics
import time


def _event_ms(fn, repeats: int = 20) -> float:
    """Median CUDA-event time of fn() in ms, after 3 warm-up calls."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _fill_graph_inputs(runner, batch: int, context: int, vocab: int) -> int:
    """Static graph buffers for `batch` sequences of `context` tokens; returns the bucket."""
    import torch

    graphs = runner.graphs
    bucket = graphs.bucket_for(batch)
    num_blocks = runner.kv_cache.shape[0]
    per_seq = -(-context // runner.block_size)
    blocks = (
        torch.randperm(num_blocks)[: batch * per_seq]
        if batch * per_seq <= num_blocks
        else torch.arange(batch * per_seq) % num_blocks
    ).view(batch, per_seq)  # (B, M)
    graphs.input_ids[:batch].copy_(torch.randint(10, vocab, (batch,)))
    graphs.positions[:batch].fill_(context - 1)
    graphs.slot_mapping.fill_(-1)
    graphs.seq_lens.zero_()
    graphs.seq_lens[:batch].fill_(context)
    graphs.block_tables[:batch, :per_seq].copy_(blocks)
    torch.cuda.synchronize()
    return bucket


def _kernel_table(replay, repeats: int = 5, top: int = 8) -> list[tuple[str, float]]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t:
            rows.append((e.key[:60], t / 1e3 / repeats))
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def _host_profile(llm, batch: int, prompt_len: int, vocab: int, steps: int = 12, top: int = 10) -> list[str]:
    """cProfile of `steps` decode-only steps of a fresh batch; the top functions by own time."""
    from splitserve.engine import SamplingParams

    engine = llm.engine
    rng = random.Random(batch + 1)
    prompts = [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    prof = cProfile.Profile()
    original = engine.step
    seen = {"n": 0}

    def step():
        decode_only = (
            bool(engine.scheduler.running)
            and not engine.scheduler.waiting
            and seen["n"] < steps
            and all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running)
        )
        if not decode_only:
            return original()
        seen["n"] += 1
        prof.enable()
        try:
            return original()
        finally:
            prof.disable()

    engine.step = step
    try:
        llm.generate(
            prompt_token_ids=prompts,
            sampling_params=SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True),
        )
    finally:
        engine.step = original
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    total = stats.total_tt
    lines = [f"{seen['n']} profiled steps, {1e3 * total / max(seen['n'], 1):.2f} ms host time per step under cProfile"]
    entries = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (file, line, name), (_, calls, own, cum, _) in entries:
        short = "/".join(file.split("/")[-2:])
        lines.append(
            f"  {1e3 * own / max(seen['n'], 1):7.3f} ms own {1e3 * cum / max(seen['n'], 1):8.3f} ms cum "
            f"{calls // max(seen['n'], 1):6d} calls/step  {short}:{line} {name}"
        )
    return lines


def profile_decode(llm, batch: int, context: int, prompt_len: int, vocab: int) -> dict:
    """Decompose one decode step of `batch` sequences at `context` tokens (see module doc)."""
    import torch

    from splitserve.common.sampling_params import SamplingParams
    from splitserve.engine.worker.sampler import SamplingRow

    runner = llm.engine.runner
    bucket = _fill_graph_inputs(runner, batch, context, vocab)
    graph = runner.graphs.graphs[bucket]
    graph_ms = _event_ms(graph.replay)
    hidden = runner.graphs.outputs[bucket][:batch]  # (B, H)
    with torch.inference_mode():
        logits_ms = _event_ms(lambda: runner.model.compute_logits(hidden))
        logits = runner.model.compute_logits(hidden)  # (B, V)
        rows = [
            SamplingRow(
                params=SamplingParams(temperature=0, ignore_eos=True),
                seed=0,
                output_position=0,
                prompt_token_ids=[1],
                output_token_ids=[],
            )
            for _ in range(batch)
        ]
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            start = time.perf_counter()
            runner.sampler(logits, rows)
            times.append(1e3 * (time.perf_counter() - start))
    kernels = _kernel_table(graph.replay)
    host = _host_profile(llm, batch, prompt_len, vocab)
    return {
        "bucket": bucket,
        "graph_ms": graph_ms,
        "logits_ms": logits_ms,
        "sample_ms": statistics.median(times),
        "graph_kernels": kernels,
        "host_profile": host,
    }


def format_profile(row: dict) -> str:
    """Human-readable block for one batch's profile row (printed by the bench)."""
    device = row["graph_ms"] + row["logits_ms"] + row["sample_ms"]
    lines = [
        f"batch {row['batch']} (graph bucket {row['bucket']}): step wall {row['decode_step_ms']:.2f} ms = "
        f"graph {row['graph_ms']:.2f} + lm_head {row['logits_ms']:.2f} + sample {row['sample_ms']:.2f} "
        f"+ other host/gaps {row['decode_step_ms'] - device:.2f}"
    ]
    lines.append("  graph kernels (device ms per replay):")
    lines += [f"    {ms:8.3f}  {name}" for name, ms in row["graph_kernels"]]
    lines.append("  host, decode steps:")
    lines += ["  " + s for s in row["host_profile"]]
    return "\n".join(lines)
