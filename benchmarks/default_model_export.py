"""Turn the GPU run's outputs into common/splitserve/common/default_model/ and measure it (CPU, here).

  python benchmarks/default_model_export.py export --run <dir the GPU run's $OUT was fetched to>
  python benchmarks/default_model_export.py check   # plain-torch TinyLlama == LlamaForCausalLM
  python benchmarks/default_model_export.py report --run <dir>  # held-out numbers, sample, PNG

The export loads the bf16 state dict into this machine's transformers LlamaForCausalLM and
calls save_pretrained, so the directory is in the format this machine's loader expects.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch
from train_default_model import TinyLlama, TinyLlamaConfig

REPO = Path(__file__).resolve().parent.parent
DEST = REPO / "common" / "splitserve" / "common" / "default_model"
PREPARED = REPO / "gpu_carry" / "model"
EOS_ID = 0
SAMPLE_PROMPT = "def fibonacci(n):"


def hf_config(cfg: TinyLlamaConfig):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=True,
        hidden_act="silu",
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        architectures=["LlamaForCausalLM"],
        dtype="bfloat16",
    )


def load_into_hf(cfg: TinyLlamaConfig, state_dict: dict):
    """LlamaForCausalLM with state_dict's weights; only the tied lm_head may be missing."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(hf_config(cfg))
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    if set(missing) - {"lm_head.weight"} or unexpected:
        raise ValueError(f"state dict does not match LlamaForCausalLM: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def export(run_dir: Path, weights: str, dest: Path = DEST) -> None:
    """Write config.json, model.safetensors (bf16), generation_config.json and tokenizer files.

    weights names the checkpoint in run_dir: model_best.safetensors (lowest held-out loss
    among the run's evaluations, what ships) or model.safetensors (the last one).
    """
    from safetensors.torch import load_file
    from transformers import GenerationConfig

    cfg = TinyLlamaConfig(**json.loads((PREPARED / "model_config.json").read_text()))
    model = load_into_hf(cfg, load_file(str(run_dir / weights)))
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    if dest.exists():
        shutil.rmtree(dest)
    model.save_pretrained(dest)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(PREPARED / "tokenizer" / name, dest / name)
    for path in dest.iterdir():
        path.chmod(0o644)  # save_pretrained writes the weights 0600 via a temp file
    total = sum(p.stat().st_size for p in dest.iterdir())
    print(f"wrote {dest}: {sorted(p.name for p in dest.iterdir())}, {total:,} bytes")


def check_equivalence() -> None:
    """Random-init TinyLlama and LlamaForCausalLM with its weights give the same logits (fp32)."""
    torch.manual_seed(0)
    cfg = TinyLlamaConfig(vocab_size=512)
    ours = TinyLlama(cfg).eval()
    theirs = load_into_hf(cfg, ours.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 300))
    with torch.no_grad():
        a, b = ours(ids), theirs(ids).logits
    err = (a - b).abs().max().item()
    print(f"max |logit difference| = {err:.2e}")
    assert err < 1e-4, err


def heldout_ppl(model, tok, text: str, max_tokens: int, ctx: int) -> tuple[float, int]:
    """Perplexity over the first max_tokens tokens of text, in independent ctx-token windows."""
    ids = torch.tensor(tok.encode(text)[: max_tokens + 1])
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, ids.numel() - 1, ctx):
            window = ids[s : s + ctx + 1]
            logits = model(window[None, :-1]).logits[0].float()  # (T, V)
            nll += torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum").item()
            n += window.numel() - 1
    return math.exp(nll / n), n


def report(run_dir: Path, dest: Path = DEST) -> None:
    """Print held-out perplexities, the unigram baseline and a greedy sample; draw the PNG."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dest)
    model = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()
    text = (REPO / "tests" / "data" / "heldout.txt").read_text()
    for max_tokens in (4096, 10**9):
        ppl, n = heldout_ppl(model, tok, text, max_tokens, 1024)
        print(f"committed held-out slice, first {n} tokens: model ppl {ppl:.3f} (loss {math.log(ppl):.4f})")
    ids = tok(SAMPLE_PROMPT, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=96, do_sample=False)
    print("greedy ids[:24]:", out[0, ids.shape[1] : ids.shape[1] + 24].tolist())
    print("sample:\n" + tok.decode(out[0]))
    log = json.loads((run_dir / "train_log.json").read_text())
    plot(log, REPO / "docs" / "default-model-loss.png")


def plot(log: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([s["step"] for s in log["steps"]], [s["loss"] for s in log["steps"]], lw=1, label="train loss (one batch)")
    ax.plot(
        [e["step"] for e in log["evals"]],
        [e["heldout_loss"] for e in log["evals"]],
        "o-",
        label="held-out loss (all held-out files)",
    )
    if "best_step" in log:
        ax.axvline(log["best_step"], color="gray", ls="--", lw=1, label=f"shipped checkpoint (step {log['best_step']})")
    ax.set_xlabel("step (65,536 tokens each)")
    ax.set_ylabel("cross entropy (nats/token)")
    ax.set_ylim(0, 4 + min(s["loss"] for s in log["steps"]))
    ax.set_title("splitserve default model: 7.3M-param Llama on the Python stdlib")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["export", "check", "report"])
    ap.add_argument("--run", type=Path, help="directory the GPU run's $OUT was fetched to")
    ap.add_argument("--weights", default="model_best.safetensors", help="checkpoint file in --run")
    args = ap.parse_args()
    if args.cmd == "check":
        check_equivalence()
    elif args.cmd == "export":
        export(args.run, args.weights)
    else:
        report(args.run)


if __name__ == "__main__":
    main()
