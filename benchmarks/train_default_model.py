"""Train splitserve's embedded default model (a tiny Llama) on the Python standard library.

Three steps, each a subcommand (docs/default-model.md has the exact commands and results):

  prepare  (CPU, here)  corpus -> byte-level BPE tokenizer -> uint16 token files in
                        gpu_carry/model/, plus tests/data/heldout.txt and the unigram table
  train    (GPU)        plain torch loop: AdamW, warmup + cosine LR over a wall-clock budget,
                        bf16 autocast; writes model.safetensors (bf16, HF Llama names) and
                        train_log.json to --out
  export   (CPU, here)  benchmarks/default_model_export.py: builds the Hugging Face directory
                        common/splitserve/common/default_model/ with this machine's transformers

The model is defined here in plain torch with exactly the parameter names and math of
transformers' LlamaForCausalLM (RMSNorm, rotate-half RoPE, SwiGLU, GQA, tied embeddings),
so the trained state dict loads into LlamaForCausalLM unchanged; the GPU machine needs
only torch, numpy and safetensors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class TinyLlamaConfig:
    """Shape of the default model (also written to config.json by the export step)."""

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 640
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 2  # GQA: 4 query heads share each KV head
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def rope_cos_sin(cfg: TinyLlamaConfig, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """HF Llama RoPE tables: (T, head_dim) cos and sin, frequencies repeated for both halves."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)  # (T, d/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, d)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # (B, H, T, D)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__()
        self.cfg = cfg
        d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(cfg.hidden_size, hq * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=False)
        self.o_proj = nn.Linear(hq * d, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        d = self.cfg.head_dim
        q = self.q_proj(x).view(b, t, -1, d).transpose(1, 2)  # (B, Hq, T, D)
        k = self.k_proj(x).view(b, t, -1, d).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        # Expand KV heads explicitly (as HF's repeat_kv does) so SDPA can take its flash path.
        k = k.repeat_interleave(group, dim=1)  # (B, Hq, T, D)
        v = v.repeat_interleave(group, dim=1)  # (B, Hq, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, Hq, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, hidden)


class Mlp(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Layer(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Mlp(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TinyLlama(nn.Module):
    """Causal LM with LlamaForCausalLM's parameter names; lm_head is tied to embed_tokens."""

    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.cfg.num_hidden_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, T) int64 -> logits (B, T, V)."""
        cos, sin = rope_cos_sin(self.cfg, ids.shape[1], ids.device)
        x = self.model.embed_tokens(ids)  # (B, T, hidden)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return F.linear(self.model.norm(x), self.model.embed_tokens.weight)  # (B, T, V)


def lm_loss(model: nn.Module, window: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (nats) over window (B, T+1)."""
    logits = model(window[:, :-1])  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())


def lr_at(progress: float, peak: float, warmup: float, floor: float) -> float:
    """Linear warmup over the first `warmup` fraction of the time budget, then cosine to floor*peak."""
    if progress < warmup:
        return peak * max(progress, 1e-3) / warmup
    p = min(1.0, (progress - warmup) / (1.0 - warmup))
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p)))


@torch.no_grad()
def evaluate(model: nn.Module, tokens: torch.Tensor, seq_len: int, batch: int) -> float:
    """Mean loss (nats/token) over non-overlapping seq_len windows of a token stream."""
    n = (tokens.numel() - 1) // seq_len
    starts = torch.arange(n, device=tokens.device) * seq_len
    total = 0.0
    for i in range(0, n, batch):
        idx = starts[i : i + batch, None] + torch.arange(seq_len + 1, device=tokens.device)  # (b, T+1)
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=tokens.is_cuda):
            total += lm_loss(model, tokens[idx]).item() * idx.shape[0]
    return total / n


def load_tokens(path: Path, device) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64)).to(device)


def save_weights(model: TinyLlama, path: Path) -> None:
    from safetensors.torch import save_file

    sd = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(sd, str(path))


def train(args: argparse.Namespace) -> None:
    """Train until --train-seconds of wall time have passed after the first (compiling) step."""
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    cfg = TinyLlamaConfig(**json.loads((args.data / "model_config.json").read_text()))
    train_tokens = load_tokens(args.data / "train.bin", device)
    heldout_tokens = load_tokens(args.data / "heldout.bin", device)
    model = TinyLlama(cfg).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"params={num_params} train_tokens={train_tokens.numel()} heldout_tokens={heldout_tokens.numel()}")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    gen = torch.Generator(device=device).manual_seed(args.seed)
    offsets = torch.arange(args.seq_len + 1, device=device)
    step_fn = compiled_or_eager(model, train_tokens[offsets].repeat(args.batch, 1), args.compile)
    log = {
        "config": asdict(cfg),
        "args": {k: str(v) for k, v in vars(args).items()},
        "num_params": num_params,
        "steps": [],
        "evals": [],
        "best_heldout_loss": float("inf"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    t0, step, last_eval = time.time(), 0, 0.0
    while (elapsed := time.time() - t0) < args.train_seconds:
        lr = lr_at(elapsed / args.train_seconds, args.lr, args.warmup, args.lr_floor)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(
            0, train_tokens.numel() - args.seq_len - 1, (args.batch, 1), device=device, generator=gen
        )
        window = train_tokens[starts + offsets]  # (B, T+1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = lm_loss(step_fn, window)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0:
            loss_val, el = loss.item(), time.time() - t0
            tok_s = step * args.batch * args.seq_len / max(el, 1e-9)
            log["steps"].append({"step": step, "elapsed_s": round(el, 2), "loss": loss_val, "lr": lr})
            print(f"step {step:6d} t={el:6.1f}s loss={loss_val:.4f} lr={lr:.2e} tok/s={tok_s:,.0f}", flush=True)
        if time.time() - t0 - last_eval >= args.eval_every_s:
            last_eval = time.time() - t0
            run_eval(model, heldout_tokens, args, log, step, last_eval)
    log["total_steps"] = step
    log["train_seconds"] = round(time.time() - t0, 1)
    log["tokens_seen"] = step * args.batch * args.seq_len
    log["epochs"] = round(log["tokens_seen"] / train_tokens.numel(), 2)
    run_eval(model, heldout_tokens, args, log, step, time.time() - t0)
    print(f"done: steps={step} train_s={log['train_seconds']} tokens={log['tokens_seen']:,} epochs={log['epochs']}")


def compiled_or_eager(model: nn.Module, sample: torch.Tensor, compile_: bool) -> nn.Module:
    """torch.compile(model) if it compiles and runs one forward/backward on sample, else model."""
    if not compile_:
        return model
    t = time.time()
    try:
        fn = torch.compile(model)
        with torch.autocast(sample.device.type, dtype=torch.bfloat16, enabled=sample.is_cuda):
            lm_loss(fn, sample).backward()
        model.zero_grad(set_to_none=True)
        print(f"torch.compile warm-up took {time.time() - t:.1f}s", flush=True)
        return fn
    except Exception as exc:  # noqa: BLE001 - any compiler failure falls back to eager
        model.zero_grad(set_to_none=True)
        print(f"torch.compile failed after {time.time() - t:.1f}s, training eagerly: {exc!r}", flush=True)
        return model


def run_eval(model, heldout_tokens, args, log, step, elapsed) -> None:
    model.eval()
    loss = evaluate(model, heldout_tokens, args.seq_len, 64)
    model.train()
    log["evals"].append({"step": step, "elapsed_s": round(elapsed, 2), "heldout_loss": loss})
    print(f"eval step {step} t={elapsed:.1f}s heldout_loss={loss:.4f} ppl={math.exp(loss):.2f}", flush=True)
    save_weights(model, args.out / "model.safetensors")
    if loss < log["best_heldout_loss"]:
        log["best_heldout_loss"], log["best_step"] = loss, step
        save_weights(model, args.out / "model_best.safetensors")
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build tokenizer and token files (CPU)")
    p.add_argument("--out", type=Path, default=Path("gpu_carry/model"))
    p.add_argument("--stdlib", type=Path, default=None, help="default: this interpreter's stdlib")
    p.add_argument("--vocab-size", type=int, default=TinyLlamaConfig.vocab_size)
    p.add_argument("--heldout-txt", type=Path, default=Path("tests/data/heldout.txt"))
    p.add_argument("--unigram-json", type=Path, default=Path("tests/data/unigram_counts.json"))
    t = sub.add_parser("train", help="train on the prepared token files")
    t.add_argument("--data", type=Path, default=Path("gpu_carry/model"))
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--train-seconds", type=float, default=320.0)
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--seq-len", type=int, default=1024)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--lr-floor", type=float, default=0.1, help="final LR as a fraction of --lr")
    t.add_argument("--warmup", type=float, default=0.03, help="warmup as a fraction of the budget")
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--eval-every-s", type=float, default=30.0)
    t.add_argument("--log-every", type=int, default=25)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        from default_model_data import prepare  # beside this script

        prepare(
            args.out,
            args.stdlib,
            asdict(TinyLlamaConfig(vocab_size=args.vocab_size)),
            args.heldout_txt,
            args.unigram_json,
        )
    else:
        train(args)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    main()
