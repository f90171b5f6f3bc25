"""Offline throughput: splitserve vs transformers `generate` vs vLLM, same model and requests.

    python -m bench.offline_throughput --engines splitserve,hf,vllm --workload cpu \
        --config bench/configs/llama-32m.json --dtype float32 --threads 2 --json out.json

Workloads (seeded; random token ids; EOS ignored; each request its own max_tokens; only the
tokens each request asked for are counted):
    cpu       64 requests, prompts U[16, 512], outputs U[16, 256]   (the engine issue's workload)
    nanovllm  256 requests, prompts and outputs U[100, 1024]
vLLM runs in its own virtual environment (--vllm-python), as a subprocess of this script.
"""

from __future__ import annotations

import argparse
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


def run_splitserve(config_path: str, requests, dtype: str, device: str, args) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(model=config_path, load_format="dummy", dtype=dtype, device=device,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              num_kv_blocks=args.num_kv_blocks)
    llm.generate(prompt_token_ids=[requests[0][0][:16]], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=[p for p, _ in requests], sampling_params=params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outs)
    return {"seconds": seconds, "output_tokens": produced, "steps": llm.engine.num_steps}


def run_hf(config_path: str, requests, dtype: str, device: str, args) -> dict:
    """One padded (left) batch through transformers generate, as a plain user would."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(Path(config_path).parent if config_path.endswith(".json") else config_path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).to(device).eval()
    max_in = max(len(p) for p, _ in requests)
    max_out = max(n for _, n in requests)
    pad = 0
    ids = torch.tensor([[pad] * (max_in - len(p)) + p for p, _ in requests], device=device)
    mask = torch.tensor([[0] * (max_in - len(p)) + [1] * len(p) for p, _ in requests], device=device)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_out, min_new_tokens=max_out,
                       do_sample=False, pad_token_id=pad)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens": sum(n for _, n in requests), "padded_tokens": max_out * len(requests)}


def vllm_inner(config_path: str, requests_path: str, dtype: str, out_path: str) -> None:
    """Runs inside vLLM's venv (imports nothing from splitserve)."""
    from vllm import LLM, SamplingParams, TokensPrompt

    requests = json.loads(Path(requests_path).read_text())
    model_dir = Path(tempfile.mkdtemp())
    shutil.copy(config_path, model_dir / "config.json")
    llm = LLM(model=str(model_dir), load_format="dummy", dtype=dtype, enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=2048, seed=0)
    llm.generate([TokensPrompt(prompt_token_ids=requests[0][0][:16])], SamplingParams(max_tokens=4, ignore_eos=True))
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    Path(out_path).write_text(json.dumps({"seconds": seconds, "output_tokens": produced}))


def run_vllm(config_path: str, requests, dtype: str, device: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        req_path, out_path = Path(tmp) / "requests.json", Path(tmp) / "out.json"
        req_path.write_text(json.dumps(requests))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", VLLM_CPU_KVCACHE_SPACE="2")
        cmd = [args.vllm_python, str(Path(__file__).resolve()), "--vllm-inner", config_path, str(req_path), dtype, str(out_path)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM run failed:\n{proc.stderr[-3000:]}")
        return json.loads(out_path.read_text())


ENGINES = {"splitserve": run_splitserve, "hf": run_hf, "vllm": run_vllm}


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--vllm-inner":
        vllm_inner(*sys.argv[2:6])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="splitserve,hf")
    ap.add_argument("--workload", default="cpu", choices=sorted(WORKLOADS))
    ap.add_argument("--config", default=str(Path(__file__).parent / "configs" / "llama-32m.json"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    vocab = json.loads(Path(args.config).read_text())["vocab_size"]
    requests = make_workload(args.workload, vocab)
    asked = sum(n for _, n in requests)
    rows = []
    for name in args.engines.split(","):
        result = ENGINES[name](args.config, requests, args.dtype, args.device, args)
        result["engine"] = name
        result["useful_tok_s"] = asked / result["seconds"]
        rows.append(result)
        print(f"{name}: {result['seconds']:.1f} s, {result['useful_tok_s']:.1f} useful tok/s", flush=True)
    base = {r["engine"]: r["useful_tok_s"] for r in rows}
    print(f"\nworkload={args.workload} requests={len(requests)} asked_tokens={asked} config={Path(args.config).name} "
          f"dtype={args.dtype} device={args.device} threads={args.threads}")
    print(f"{'engine':<12}{'seconds':>10}{'useful tok/s':>15}{'vs splitserve':>15}")
    for r in rows:
        ratio = base.get("splitserve", r["useful_tok_s"]) / r["useful_tok_s"]
        print(f"{r['engine']:<12}{r['seconds']:>10.1f}{r['useful_tok_s']:>15.1f}{ratio:>14.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
