"""Offline throughput: splitserve vs transformers `generate` vs vLLM, same model and requests.

    python benchmarks/offline_throughput.py --engines splitserve,hf,vllm --workload cpu \
        --config benchmarks/configs/llama-32m.json --dtype float32 --threads 2 --json out.json

Workloads (seeded; random token ids; EOS ignored; each request its own max_tokens; only the
tokens each request asked for are counted):
    cpu       64 requests, prompts U[16, 512], outputs U[16, 256]   (the CPU comparison's workload)
    nanovllm  256 requests, prompts and outputs U[100, 1024]
vLLM runs in its own virtual environment (--vllm-python), as a subprocess of this script.

splitserve variants (in --engines, each measured in the same run): `splitserve` (the --dtype model and
KV cache), `splitserve:fp8kv` (fp8 KV cache), `splitserve:fp8w` (fp8 weights), `splitserve:fp8`
(both; W8A8 projections at every size, the engine's default), `splitserve:fp8w8a16` (both, and decode
steps of up to 16 rows through the W8A16 kernel: --fp8-w8a16-max-rows 16, on the device's measured tiles),
`splitserve:fp8w8a16own` (the same on the kernel's own tiles), `splitserve:fp8swept` (as
fp8w8a16, the kernel on the tiles --fp8-tiles names: a kernel_timings.py --sections fp8linear JSON, whose
sweep picked them), `splitserve:gemv` (one-row bf16 projections on the GEMV tiles of that sweep, where they
beat cuBLAS), `splitserve:cublas` (cuBLAS for every projection, the GEMV's measured defaults off),
`splitserve:nopdl` / `splitserve:fp8swept+nopdl` (splitserve.kernels.pdl off: no programmatic dependent launch),
`splitserve:fp8kv+rows` / `splitserve:fp8w8a16+rows` (the Triton "rows" fp8 decode attention, not the mma kernel),
`splitserve:fp8kv+s2` (the mma kernel on two sequences a program), `splitserve:fp8kv+e0` (its one-warp programs'
output through the shared-memory merge), `splitserve:sched` /
`splitserve:fp8kv+sched` (decode steps' rows in the scheduler's order, not longest first),
`splitserve:fp8block` / `:fp8block+kv` (a block-wise fp8 checkpoint of the --config model, 128 x 128 tiles as
DeepSeek-V3's and Qwen3's FP8 releases, written to a temporary directory and loaded; with an fp8 KV cache),
e.g. --engines
splitserve,splitserve:fp8kv --workload nanovllm. Each splitserve engine is timed in every --scheduling
mode (default sync,async: the synchronous loop, and asynchronous scheduling), rows named VARIANT-MODE;
--gpu-busy adds the device's busy share of each (CUDA), --host-profile a cProfile.

--avx2 ours|both on an AVX-512 CPU: splitserve (and with `both` vLLM too) runs what an AVX2-only CPU would
(torch, MKL, oneDNN capped at AVX2; our ops' x86-64-v3 build; vLLM's _C_AVX2 kernels).

--pairs N: the engines run in turn, N rounds (e.g. splitserve, vllm, splitserve, vllm, ...), each run a
fresh engine, so a drift of a shared host moves both alike; the table gives each round's seconds and the
first engine's speed against the others'.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOADS = {
    "cpu": dict(num_requests=64, prompt=(16, 512), output=(16, 256)),
    "nanovllm": dict(num_requests=256, prompt=(100, 1024), output=(100, 1024)),
}


def make_workload(name: str, vocab_size: int, seed: int = 0) -> list[tuple[list[int], int]]:
    spec = WORKLOADS[name]
    rng = random.Random(seed)
    requests = []
    for _ in range(spec["num_requests"]):
        n_in = rng.randint(*spec["prompt"])
        n_out = rng.randint(*spec["output"])
        requests.append(([rng.randrange(10, vocab_size) for _ in range(n_in)], n_out))
    return requests


# splitserve variant -> its engine options
VARIANTS = {
    "": {},
    "fp8kv": {"kv_cache_dtype": "fp8"},
    "fp8w": {"quantization": "fp8"},
    "fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
    # fp8 with steps of up to 16 rows W8A16 (splitserve.kernels.fp8_skinny_linear) as a user runs it: the device's
    # tuned tiles (splitserve.kernels.tuned_configs, a data file under kernels/splitserve/kernels/configs/ for an
    # H200), else the kernel's own
    "fp8w8a16": {"quantization": "fp8", "kv_cache_dtype": "fp8", "fp8_w8a16_max_rows": 16},
    # the same on the kernel's own tiles everywhere (splitserve.engine.worker.fp8.W8A16_TILES {})
    "fp8w8a16own": {"quantization": "fp8", "kv_cache_dtype": "fp8", "fp8_w8a16_max_rows": 16, "own_tiles": True},
    # the same on the W8A16 tiles of --fp8-tiles (kernel_timings.py --sections fp8linear's sweep)
    "fp8swept": {"quantization": "fp8", "kv_cache_dtype": "fp8", "fp8_w8a16_max_rows": 16, "swept_tiles": True},
    "gemv": {"gemv_tiles": True},  # bf16; one-row projections on the GEMV where --fp8-tiles' sweep beat cuBLAS
    "cublas": {"no_gemv": True},  # bf16, cuBLAS for every projection (the one-row GEMV off: GEMV_TILES {})
    "nopdl": {"pdl": False},  # bf16 with splitserve.kernels.pdl off: no programmatic dependent launch (default on)
    # fp8 KV / fp8w8a16 with the Triton "rows" decode attention instead of the mma kernel (fp8_mma.ENABLED False)
    "fp8kv+rows": {"kv_cache_dtype": "fp8", "fp8_mma": False},
    "fp8w8a16+rows": {"quantization": "fp8", "kv_cache_dtype": "fp8", "fp8_w8a16_max_rows": 16, "fp8_mma": False},
    # fp8 KV with the mma kernel taking two sequences a program (its SEQS option; one by default)
    "fp8kv+s2": {"kv_cache_dtype": "fp8", "fp8_mma_options": {"SEQS": 2}},
    # fp8 KV with one-warp mma programs merging through shared memory (its EPI option off: on by default)
    "fp8kv+e0": {"kv_cache_dtype": "fp8", "fp8_mma_options": {"EPI": 0}},
    # a block-wise fp8 checkpoint (128 x 128 tiles, weight_scale_inv: DeepSeek-V3's and Qwen3's FP8 form) of the
    # --config model's random weights, written to a temporary directory and loaded from it
    "fp8block": {"block_checkpoint": True},
    "fp8block+kv": {"block_checkpoint": True, "kv_cache_dtype": "fp8"},
    # decode-only steps' rows in the scheduler's order (splitserve.engine.worker.model_runner.ModelRunner
    # .LONGEST_FIRST off; on by default), bf16 / fp8 KV
    "sched": {"longest_first": False},
    "fp8kv+sched": {"kv_cache_dtype": "fp8", "longest_first": False},
    "fp8swept+nopdl": {
        "quantization": "fp8",
        "kv_cache_dtype": "fp8",
        "fp8_w8a16_max_rows": 16,
        "swept_tiles": True,
        "pdl": False,
    },
}


def variant_options(engine: str) -> dict:
    """`splitserve` or `splitserve:VARIANT` -> the engine options of that variant."""
    _, _, variant = engine.partition(":")
    if variant not in VARIANTS:
        raise SystemExit(f"unknown splitserve variant {variant!r}; choose one of {', '.join(v for v in VARIANTS if v)}")
    return VARIANTS[variant]


@contextlib.contextmanager
def measured_tiles(options: dict, tiles_json: str):
    """Pops "swept_tiles", "gemv_tiles", "no_gemv", "own_tiles", "fp8_mma", "fp8_mma_options", "longest_first"
    and "pdl" from `options`; while the block runs:
    - splitserve.engine.worker.fp8.W8A16_TILES (read by the fp8 layers when finalized) or
      splitserve.engine.worker.fused_ops.GEMV_TILES (read at each call) hold --fp8-tiles' measured tiles in place
      of the device's tuned table (splitserve.kernels.tuned_configs);
    - "no_gemv" sets GEMV_TILES to {} (cuBLAS for every projection), "own_tiles" W8A16_TILES to {} (the
      kernel's own tiles);
    - "pdl" sets splitserve.kernels.pdl.ENABLED (programmatic dependent launch of the Triton kernels; on by
      default);
    - "fp8_mma" sets splitserve.kernels.paged_decode_attention_fp8_mma.ENABLED (the fp8 decode attention's
      default kernel), "fp8_mma_options" overrides keys of its DEFAULT_OPTIONS;
    - "longest_first" sets splitserve.engine.worker.model_runner.ModelRunner.LONGEST_FIRST."""
    from fp8_linear import gemv_tiles, swept_tiles

    from splitserve.engine.worker import fp8 as quant
    from splitserve.engine.worker import fused_ops

    readers = {"swept_tiles": (quant, "W8A16_TILES", swept_tiles), "gemv_tiles": (fused_ops, "GEMV_TILES", gemv_tiles)}
    from_json = [readers[key] for key in readers if options.pop(key, False)]
    if from_json and not tiles_json:
        raise SystemExit(
            "splitserve:fp8swept and :gemv need --fp8-tiles (a kernel_timings.py --sections fp8linear JSON)"
        )
    tables = [(module, name, read(tiles_json)) for module, name, read in from_json]
    if options.pop("no_gemv", False):
        tables.append((fused_ops, "GEMV_TILES", {}))
    if options.pop("own_tiles", False):
        tables.append((quant, "W8A16_TILES", {}))
    if "fp8_mma" in options:
        from splitserve.kernels import paged_decode_attention_fp8_mma as fp8_mma

        tables.append((fp8_mma, "ENABLED", options.pop("fp8_mma")))
    if "fp8_mma_options" in options:
        from splitserve.kernels import paged_decode_attention_fp8_mma as fp8_mma

        tables.append((fp8_mma, "DEFAULT_OPTIONS", dict(fp8_mma.DEFAULT_OPTIONS, **options.pop("fp8_mma_options"))))
    if "longest_first" in options:
        from splitserve.engine.worker.model_runner import ModelRunner

        tables.append((ModelRunner, "LONGEST_FIRST", options.pop("longest_first")))
    if "pdl" in options:
        from splitserve.kernels import pdl

        tables.append((pdl, "ENABLED", options.pop("pdl")))
    saved = [(module, name, getattr(module, name)) for module, name, _ in tables]
    for module, name, table in tables:
        setattr(module, name, table)
        print(f"{name}: {table}", flush=True)
    try:
        yield
    finally:
        for module, name, table in saved:
            setattr(module, name, table)


def run_splitserve(
    config_path: str, requests, dtype: str, device: str, args, variant: str = "splitserve"
) -> list[dict]:
    """One engine of `variant`, each `--scheduling` mode timed in turn (sync: read each step as it is launched;
    async: launch step N+1, then read step N), rows named VARIANT-MODE; with --gpu-busy on CUDA, each mode's
    device share of the wall."""
    options = dict(variant_options(variant))
    with measured_tiles(options, args.fp8_tiles):  # measured tiles hold while this engine runs
        return _run_engine(config_path, requests, dtype, device, args, variant, options)


def _run_engine(config_path: str, requests, dtype: str, device: str, args, variant: str, options: dict) -> list[dict]:
    from splitserve.engine import LLM, SamplingParams

    llm = _load_engine(
        LLM,
        config_path,
        options,
        dtype=dtype,
        device=device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        kv_cache_memory_fraction=args.kv_fraction,
    )
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    prompts = [p for p, _ in requests]
    if device.startswith("cuda"):  # the whole workload once: every kernel variant it needs compiled and tuned
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
    else:
        llm.generate(prompt_token_ids=[prompts[0][:16]], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
    first_tokens = None
    rows = []
    for mode in [m for _ in range(args.repeats) for m in args.scheduling.split(",")]:
        row = _timed_pass(llm, prompts, params, mode, device, f"{variant}-{mode}")
        tokens = row.pop("tokens")
        first_tokens = first_tokens if first_tokens is not None else tokens
        row["same_tokens_as_first_row"] = tokens == first_tokens
        row["max_num_batched_tokens"] = llm.engine.info.max_num_batched_tokens
        rows.append(row)
        print(rows[-1], flush=True)
    if args.gpu_busy and device.startswith("cuda"):
        _gpu_busy(llm, prompts, params, rows)
    if args.host_profile:
        _host_profile(llm, prompts, params, args.scheduling.split(",")[-1])
    llm.close()  # its device memory back before the next engine sizes its KV pool (the collector is frozen)
    return rows


def _load_engine(llm_class, config_path: str, options: dict, **engine_args):
    """An engine of `config_path`'s model with random weights: a dummy load, or for splitserve:fp8block (option
    "block_checkpoint", popped) a block-wise fp8 checkpoint of them written to a temporary directory, loaded, then
    deleted (an 8B checkpoint is ~10 GB)."""
    if not options.pop("block_checkpoint", False):
        return llm_class(model=config_path, load_format="dummy", **engine_args, **options)
    from fp8_block_linear import write_block_checkpoint

    directory = tempfile.mkdtemp()
    try:
        model = write_block_checkpoint(config_path, directory, "cpu")
        return llm_class(model=model, load_format="auto", **engine_args, **options)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _timed_pass(llm, prompts, params, mode: str, device: str, name: str) -> dict:
    """One run of the workload from a cold prefix cache. Modes: sync, async, and async-nogc (the garbage
    collector off during the run: what its pauses cost)."""
    import gc

    from gpu_busy import HostSplit

    llm.engine.async_scheduling = mode.startswith("async")
    llm.engine.pool.reset_prefix_cache()  # an earlier pass's prompts must not be cache hits
    steps_before = llm.engine.num_steps
    _sync(device)
    with HostSplit(llm.engine) as split:
        if mode.endswith("nogc"):
            gc.disable()
        started_at, start = time.time(), time.perf_counter()
        try:
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            _sync(device)
        finally:
            gc.enable()
        seconds = time.perf_counter() - start
    host = {k: round(v, 3) for k, v in split.seconds.items()}
    host["rest"] = round(seconds - sum(split.seconds.values()), 3)
    return {
        "engine": name,
        "seconds": seconds,
        "output_tokens": sum(len(o.token_ids) for o in outs),
        "steps": llm.engine.num_steps - steps_before,
        "host_s": host,
        "tokens": [o.token_ids for o in outs],
        "window": (started_at, started_at + seconds),
    }


def _host_profile(llm, prompts, params, mode: str, top: int = 25) -> None:
    """cProfile one run in `mode`: where the host's time goes (cumulative, per step)."""
    import cProfile
    import pstats

    llm.engine.async_scheduling = mode.startswith("async")
    llm.engine.pool.reset_prefix_cache()
    steps_before = llm.engine.num_steps
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    prof.disable()
    steps = max(llm.engine.num_steps - steps_before, 1)
    stats = pstats.Stats(prof)
    print(f"\nhost profile, {mode}: {steps} steps, {1e3 * stats.total_tt / steps:.2f} ms per step under cProfile")
    for (file, line, name), (_, calls, own, cum, _) in sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:top]:
        short = "/".join(file.split("/")[-2:])
        print(
            f"  {1e3 * cum / steps:8.3f} ms cum {1e3 * own / steps:7.3f} ms own {calls // steps:6d}/step "
            f"{short}:{line} {name}"
        )


def _gpu_busy(llm, prompts, params, rows: list[dict]) -> None:
    """Per mode: device activity (profiled run) and step spans (unprofiled run) as shares of its wall."""
    from gpu_busy import StepSpans, device_activity

    for mode in dict.fromkeys(r["engine"].split("-", 1)[1] for r in rows):
        llm.engine.async_scheduling = mode.startswith("async")
        llm.engine.pool.reset_prefix_cache()
        kernel_s, by_name = device_activity(lambda: llm.generate(prompt_token_ids=prompts, sampling_params=params))
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
        llm.engine.pool.reset_prefix_cache()
        with StepSpans(llm.engine.runner) as spans:
            _sync("cuda")
            start = time.perf_counter()
            llm.generate(prompt_token_ids=prompts, sampling_params=params)
            _sync("cuda")
            wall = time.perf_counter() - start
        span_s = spans.total_s()
        for row in rows:
            if row["engine"].split("-", 1)[1] == mode:
                row.update(kernel_busy_s=kernel_s, step_span_s=span_s, span_run_wall_s=wall, top_kernels=top)


def run_hf(config_path: str, requests, dtype: str, device: str, args) -> dict:
    """One padded (left) batch through transformers generate, as a plain user would."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(_config_dir(config_path) if config_path.endswith(".json") else config_path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).to(device).eval()
    max_in = max(len(p) for p, _ in requests)
    max_out = max(n for _, n in requests)
    pad = 0
    ids = torch.tensor([[pad] * (max_in - len(p)) + p for p, _ in requests], device=device)
    mask = torch.tensor([[0] * (max_in - len(p)) + [1] * len(p) for p, _ in requests], device=device)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_out,
            min_new_tokens=max_out,
            do_sample=False,
            pad_token_id=pad,
        )
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens": sum(n for _, n in requests), "padded_tokens": max_out * len(requests)}


def vllm_inner(config_path: str, requests_path: str, dtype: str, out_path: str) -> None:
    """Runs inside vLLM's venv (imports nothing from splitserve)."""
    from vllm import LLM, SamplingParams, TokensPrompt

    requests = json.loads(Path(requests_path).read_text())
    model_dir = Path(tempfile.mkdtemp())
    shutil.copy(config_path, model_dir / "config.json")
    llm = LLM(
        model=str(model_dir),
        load_format="dummy",
        dtype=dtype,
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=2048,
        seed=0,
    )
    llm.generate([TokensPrompt(prompt_token_ids=requests[0][0][:16])], SamplingParams(max_tokens=4, ignore_eos=True))
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in requests]
    started_at, start = time.time(), time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    window = (started_at, started_at + seconds)
    Path(out_path).write_text(json.dumps({"seconds": seconds, "output_tokens": produced, "window": window}))


# --avx2 on an AVX-512 machine: what an AVX2-only CPU would run. torch's own kernels (ATen's dispatch), MKL and
# oneDNN are capped at AVX2 and our C++ ops load their x86-64-v3 build.
AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "SPLITSERVE_CPU_ISA": "avx2",
}
# vLLM picks its kernel library (and attention ISA) from the CPU's flags, not from those variables: started
# with this sitecustomize (every process it spawns too), it sees a CPU without AVX-512 and loads _C_AVX2.
_VLLM_AVX2_SITECUSTOMIZE = """
import torch.cpu
torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
torch.cpu._is_amx_tile_supported = lambda: False
"""


def run_vllm(config_path: str, requests, dtype: str, device: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        req_path, out_path = Path(tmp) / "requests.json", Path(tmp) / "out.json"
        req_path.write_text(json.dumps(requests))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and k not in AVX2_ENV}
        # PYTHONSAFEPATH: neither this script's folder nor a cwd on sys.path, in vLLM's processes too
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", VLLM_CPU_KVCACHE_SPACE="2", PYTHONSAFEPATH="1")
        if args.avx2 == "both":
            env.update(AVX2_ENV, PYTHONPATH=tmp)
            (Path(tmp) / "sitecustomize.py").write_text(_VLLM_AVX2_SITECUSTOMIZE)
        cmd = [
            args.vllm_python,
            str(Path(__file__).resolve()),
            "--vllm-inner",
            config_path,
            str(req_path),
            dtype,
            str(out_path),
        ]
        # cwd outside the repository as well: its top-level folders (kernels/, engine/) have generic names
        proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM run failed:\n{proc.stderr[-3000:]}")
        return json.loads(out_path.read_text())


ENGINES = {"splitserve": run_splitserve, "hf": run_hf, "vllm": run_vllm}


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def fixed_splitserve(llm, batch: int, prompt_len: int, output_len: int, vocab: int, device: str) -> dict:
    """One batch of identical-length requests; per-step wall times split into prefill and decode."""
    from splitserve.engine import SamplingParams

    rng = random.Random(batch)
    prompts = [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    engine = llm.engine
    step_times: list[tuple[int, float]] = []
    original = engine.step

    def timed_step():
        start = time.perf_counter()
        outs = original()
        step_times.append((len(engine.scheduler.running), time.perf_counter() - start))
        return outs

    engine.step = timed_step
    try:
        _sync(device)
        start = time.perf_counter()
        outs = llm.generate(
            prompt_token_ids=prompts,
            sampling_params=SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True),
        )
        _sync(device)
        total = time.perf_counter() - start
    finally:
        engine.step = original
    assert all(len(o.token_ids) == output_len for o in outs)
    # steps after the last prompt token: decode-only steps of the whole batch
    num_prefill_steps = _num_prefill_steps(prompt_len, batch, llm.engine.info.max_num_batched_tokens)
    decode = sorted(t for _, t in step_times[num_prefill_steps:])
    return {
        "batch": batch,
        "decode_step_ms": 1e3 * decode[len(decode) // 2] if decode else float("nan"),
        "decode_step_p10_ms": 1e3 * decode[len(decode) // 10] if decode else float("nan"),
        "decode_step_p90_ms": 1e3 * decode[(9 * len(decode)) // 10] if decode else float("nan"),
        "prefill_ms": 1e3 * sum(t for _, t in step_times[:num_prefill_steps]),
        "seconds": total,
        "output_tok_s": batch * output_len / total,
    }


def _num_prefill_steps(prompt_len: int, batch: int, budget: int) -> int:
    """Steps until every prompt is computed (the step that finishes a prompt also samples)."""
    return -(-(prompt_len * batch) // budget)


def fixed_hf(model, batch: int, prompt_len: int, output_len: int, vocab: int, device: str) -> dict:
    """transformers generate, eager, default cache: decode step = (t(out) - t(1)) / (out - 1)."""
    import torch

    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(10, vocab, (batch, prompt_len), generator=g).to(device)
    times = {}
    for n in (1, output_len):
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        _sync(device)
        times[n] = time.perf_counter() - start
    step = (times[output_len] - times[1]) / (output_len - 1)
    return {
        "batch": batch,
        "decode_step_ms": 1e3 * step,
        "prefill_ms": 1e3 * times[1],
        "seconds": times[output_len],
        "output_tok_s": batch * output_len / times[output_len],
    }


def roofline_ms(
    config: dict,
    batch: int,
    context: int,
    bytes_per_s: float = 4.28e12,
    flops: float = 790e12,
    weight_bytes: float = 2,
    kv_bytes_per_elem: float = 2,
) -> float:
    """The decode-step floor for this config (weights + KV read, or matmul FLOPs); fp8 weights
    read one byte a projection parameter (embeddings and LM head stay 16-bit), an fp8 KV one an element.
    A mixture of experts reads the experts its batch hits and multiplies each token by its top k."""
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim", h // heads)
    head_params = vocab * h * (1 if config.get("tie_word_embeddings") else 2)
    mlp_read, mlp_used = _mlp_params(config, batch)
    attn_params = h * d * (heads + 2 * kv_heads) + heads * d * h
    layer_params = layers * (attn_params + mlp_read)
    kv_bytes = 2 * layers * kv_heads * d * kv_bytes_per_elem
    t_mem = (head_params * 2 + layer_params * weight_bytes + batch * context * kv_bytes) / bytes_per_s
    t_flop = 2 * (head_params + layers * (attn_params + mlp_used)) * batch / flops
    return 1e3 * max(t_mem, t_flop)


def _mlp_params(config: dict, batch: int) -> tuple[float, float]:
    """(MLP parameters a decode step of `batch` tokens reads per layer, those one token multiplies). Experts: the
    expected number a batch of uniformly routed tokens hits (every layer taken as sparse)."""
    h = config["hidden_size"]
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    if not num_experts:
        dense = 3 * h * config["intermediate_size"]
        return dense, dense
    top_k = config["num_experts_per_tok"]
    per_expert = 3 * h * (config.get("moe_intermediate_size") or config["intermediate_size"])
    hit = num_experts * (1 - (1 - top_k / num_experts) ** batch)
    return hit * per_expert, top_k * per_expert


def run_fixed(args) -> list[dict]:
    """Fixed shapes: prompt 512, 128 forced outputs, several batch sizes (the GPU decode-step comparison)."""
    config = json.loads(Path(args.config).read_text())
    vocab = config["vocab_size"]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for engine in [e for e in args.engines.split(",") if e.partition(":")[0] == "splitserve"]:
        options = dict(variant_options(engine))
        with measured_tiles(options, args.fp8_tiles):  # measured tiles hold while this engine runs
            rows += _fixed_engine(args, engine, options, batches, vocab)
        if args.device.startswith("cuda"):
            import gc

            import torch

            gc.collect()
            torch.cuda.empty_cache()
    if "hf" in args.engines:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_config = AutoConfig.from_pretrained(_config_dir(args.config))
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, args.dtype)).eval()
        fixed_hf(model, 1, 32, 4, vocab, args.device)
        for b in batches:
            row = fixed_hf(model, b, args.prompt_len, args.output_len, vocab, args.device)
            rows.append({"engine": "hf", **row})
            print(rows[-1], flush=True)
        del model
    context = args.prompt_len + args.output_len // 2
    print(
        f"\nfixed shapes: prompt {args.prompt_len}, output {args.output_len} forced, config {Path(args.config).name}, "
        f"{args.dtype}, {args.device}"
    )
    print(
        f"{'engine':<18}{'batch':>6}{'decode step ms':>16}{'floor ms':>10}{'x floor':>9}{'prefill ms':>12}{'tok/s':>10}"
    )
    for r in rows:
        options = variant_options(r["engine"].split("[")[0]) if r["engine"].startswith("splitserve") else {}
        floor = roofline_ms(
            config,
            r["batch"],
            context,
            weight_bytes=1 if "quantization" in options or options.get("block_checkpoint") else 2,
            kv_bytes_per_elem=1 if "kv_cache_dtype" in options else 2,
        )
        r["floor_ms"] = floor
        print(
            f"{r['engine']:<18}{r['batch']:>6}{r['decode_step_ms']:>16.2f}{floor:>10.2f}"
            f"{r['decode_step_ms'] / floor:>9.2f}"
            f"{r['prefill_ms']:>12.1f}{r['output_tok_s']:>10.0f}"
        )
    return rows


def _fixed_engine(args, engine: str, options: dict, batches: list[int], vocab: int) -> list[dict]:
    from splitserve.engine import LLM

    rows = []
    llm = _load_engine(
        LLM,
        args.config,
        options,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(batches),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        kv_cache_memory_fraction=args.kv_fraction,
    )
    fixed_splitserve(llm, 2, 32, 4, vocab, args.device)  # warm up
    modes = args.scheduling.split(",")
    for b in batches:
        for mode in modes:  # alternate per batch, so a drift of the host moves every mode alike
            llm.engine.async_scheduling = mode.startswith("async")
            llm.engine.pool.reset_prefix_cache()  # the same prompts again: no cache hits
            row = fixed_splitserve(llm, b, args.prompt_len, args.output_len, vocab, args.device)
            label = engine if len(modes) == 1 else f"{engine}[{mode}]"
            rows.append({"engine": label, "scheduling": mode, **row})
            print(rows[-1], flush=True)
        if args.profile and llm.engine.runner.graphs is not None:
            from decode_profile import format_profile, profile_decode

            rows[-1].update(profile_decode(llm, b, args.prompt_len + args.output_len // 2, args.prompt_len, vocab))
            print(format_profile(rows[-1]), flush=True)
    llm.close()
    return rows


def run_pairs(args, requests, asked: int) -> list[dict]:
    """--pairs rounds of every engine in --engines order (splitserve in one --scheduling mode), one row each."""
    names = args.engines.split(",")
    if len(names) < 2 or len(args.scheduling.split(",")) != 1:
        raise SystemExit("--pairs needs two or more --engines and one --scheduling mode (e.g. --scheduling sync)")

    from host_load import OthersLoad, wait_for_quiet

    rows = []
    with OthersLoad() as others:
        for round_index in range(args.pairs):
            for name in names:
                waited_s = wait_for_quiet(args.quiet_share, timeout_s=args.quiet_wait_s) if args.quiet_share else 0.0
                rows.append(_pair_run(args, name, requests, asked, round_index + 1))
                rows[-1].update(waited_for_quiet_s=waited_s, others_share=others.share(*rows[-1]["window"]))
                print(
                    f"round {round_index + 1}, {name}: {rows[-1]['seconds']:.2f} s, the other processes used "
                    f"{100 * rows[-1]['others_share']:.0f}% of the machine (waited {waited_s:.0f} s for quiet)",
                    flush=True,
                )
    return rows


def _pair_run(args, name: str, requests, asked: int, round_index: int) -> dict:
    """One engine's run of the workload, a fresh engine."""
    import gc

    if name.startswith("splitserve"):
        result = run_splitserve(args.config, requests, args.dtype, args.device, args, variant=name)[0]
        result["engine"] = name
        gc.collect()  # the engine and its KV pool gone before the next engine starts
    else:
        result = {"engine": name, **ENGINES[name](args.config, requests, args.dtype, args.device, args)}
    result.update(round=round_index, useful_tok_s=asked / result["seconds"])
    return result


def _print_pairs(rows: list[dict]) -> None:
    """One line per round: each engine's seconds (useful tok/s) [the share of the machine other processes used
    meanwhile] and the first engine's speed against each other."""
    names = list(dict.fromkeys(r["engine"] for r in rows))
    print(
        "| round | "
        + " | ".join(f"{n} s (tok/s) [others' share]" for n in names)
        + " | "
        + " | ".join(f"{names[0]} vs {n}" for n in names[1:])
        + " |"
    )
    print("|---" * (1 + 2 * len(names) - 1) + "|")
    for round_index in sorted({r["round"] for r in rows}):
        by_name = {r["engine"]: r for r in rows if r["round"] == round_index}
        cells = [
            f"{by_name[n]['seconds']:.2f} ({by_name[n]['useful_tok_s']:.1f}) [{100 * by_name[n]['others_share']:.0f}%]"
            for n in names
        ]
        ratios = [f"{by_name[n]['seconds'] / by_name[names[0]]['seconds']:.2f}x" for n in names[1:]]
        print(f"| {round_index} | " + " | ".join(cells + ratios) + " |")


def _print_table(rows: list[dict]) -> None:
    """Seconds, useful tok/s and the ratio to the first row; the device's shares of the wall when measured."""
    print(
        f"{'engine':<18}{'seconds':>9}{'useful tok/s':>14}{'vs first':>10}{'steps':>7}"
        f"{'kernel busy':>13}{'step span':>11}"
    )
    for r in rows:
        busy = span = ""
        if "kernel_busy_s" in r:
            busy = f"{r['kernel_busy_s']:.2f}s {100 * r['kernel_busy_s'] / r['seconds']:.0f}%"
            span = f"{100 * r['step_span_s'] / r['span_run_wall_s']:.0f}%"
        print(
            f"{r['engine']:<18}{r['seconds']:>9.2f}{r['useful_tok_s']:>14.1f}"
            f"{r['useful_tok_s'] / rows[0]['useful_tok_s']:>9.2f}x"
            f"{r.get('steps', ''):>7}{busy:>13}{span:>11}"
        )
    for r in rows:
        if "host_s" in r:
            print(f"host seconds, {r['engine']}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["host_s"].items()))
    for r in rows:
        if "top_kernels" in r:  # the profiled run's device seconds by activity name, most first
            print(f"device seconds, {r['engine']}: " + "; ".join(f"{n[:60]} {v:.3f}" for n, v in r["top_kernels"]))


def _config_dir(config_path: str) -> str:
    """transformers wants a directory with config.json: make one beside the bench config."""
    directory = Path(tempfile.mkdtemp())
    shutil.copy(config_path, directory / "config.json")
    return str(directory)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--vllm-inner":
        vllm_inner(*sys.argv[2:6])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="splitserve,hf")
    ap.add_argument("--workload", default="cpu", choices=sorted(WORKLOADS) + ["fixed"])
    ap.add_argument("--config", default=str(Path(__file__).parent / "configs" / "llama-32m.json"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="unset = the engine's default (16,384 on an H200)"
    )
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    ap.add_argument("--batch-sizes", default="1,16,64,128", help="fixed workload only")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--profile", action="store_true", help="fixed workload, CUDA graphs: decompose a decode step")
    ap.add_argument("--kv-fraction", type=float, default=0.5, help="kv_cache_memory_fraction on CUDA")
    ap.add_argument(
        "--scheduling",
        default="sync,async",
        help="modes each splitserve engine is timed in, in turn: sync, async, async-nogc (collector off)",
    )
    ap.add_argument("--repeats", type=int, default=1, help="times each --scheduling mode is timed")
    ap.add_argument("--pairs", type=int, default=0, help="rounds of the --engines run in turn (alternating pairs)")
    ap.add_argument(
        "--quiet-share",
        type=float,
        default=0.0,
        help="--pairs: before each run wait until other processes use less than this share of the machine (0: no wait)",
    )
    ap.add_argument("--quiet-wait-s", type=float, default=600.0, help="the longest such wait; the run starts anyway")
    ap.add_argument("--gpu-busy", action="store_true", help="CUDA: each variant's device busy share (profiled run)")
    ap.add_argument("--host-profile", action="store_true", help="cProfile one run of the last --scheduling mode")
    ap.add_argument("--fp8-tiles", default="", help="splitserve:fp8swept and :gemv: kernel_timings.py's JSON")
    ap.add_argument(
        "--avx2",
        default="off",
        choices=["off", "ours", "both"],
        help="an AVX-512 CPU run as an AVX2-only one (AVX2_ENV): for splitserve alone, or for vLLM too",
    )
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if args.avx2 != "off":
        os.environ.update(AVX2_ENV)  # before torch is imported: ATen reads its capability once

    import torch

    torch.set_num_threads(args.threads)
    if args.workload == "fixed":
        rows = run_fixed(args)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "results": rows}, indent=2))
        return 0
    vocab = json.loads(Path(args.config).read_text())["vocab_size"]
    requests = make_workload(args.workload, vocab)
    asked = sum(n for _, n in requests)
    if args.pairs:
        rows = run_pairs(args, requests, asked)
        print(f"\nworkload={args.workload} asked_tokens={asked} dtype={args.dtype} threads={args.threads}")
        _print_pairs(rows)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "results": rows}, indent=2))
        return 0
    rows = []
    for name in args.engines.split(","):
        if name.startswith("splitserve"):
            results = run_splitserve(args.config, requests, args.dtype, args.device, args, variant=name)
        else:
            results = [ENGINES[name](args.config, requests, args.dtype, args.device, args)]
        for result in results:
            result.setdefault("engine", name)
            result["useful_tok_s"] = asked / result["seconds"]
            rows.append(result)
            print(
                f"{result['engine']}: {result['seconds']:.2f} s, {result['useful_tok_s']:.1f} useful tok/s", flush=True
            )
    print(
        f"\nworkload={args.workload} requests={len(requests)} asked_tokens={asked} config={Path(args.config).name} "
        f"dtype={args.dtype} device={args.device} threads={args.threads} "
        f"token budget={sorted({r.get('max_num_batched_tokens', args.max_num_batched_tokens) for r in rows}, key=str)}"
    )
    _print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
