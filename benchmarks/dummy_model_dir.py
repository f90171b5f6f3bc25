"""A model directory for dummy-weight benchmarks: a bench config plus a word-level tokenizer that
covers the whole vocabulary (token i is the word "w<i>"), so the gateway can tokenize, detokenize
and check stop strings for a model shape that has no tokenizer of its own (e.g. the Llama-3-8B one).

    python benchmarks/dummy_model_dir.py benchmarks/configs/llama3-8b.json /tmp/llama3-8b-dummy

Serve it with `--model /tmp/llama3-8b-dummy --load-format dummy` (engines and gateway alike).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

MARKER = "made-by-bench-dummy_model_dir"  # a directory holding this file may be replaced


def special_ids(config: dict) -> tuple[int, list[int]]:
    """(bos, eos ids) from a config, each checked against the vocabulary."""
    vocab_size = int(config["vocab_size"])
    bos = int(config.get("bos_token_id", 1))
    eos = config.get("eos_token_id", 2)
    eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    for name, token_id in [("bos_token_id", bos)] + [("eos_token_id", e) for e in eos_ids]:
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"{name} {token_id} is outside the vocabulary [0, {vocab_size})")
    return bos, eos_ids


def make_dummy_model_dir(config_path: str | Path, out_dir: str | Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = json.loads(Path(config_path).read_text())
    bos, eos_ids = special_ids(config)
    vocab = {f"w{i}": i for i in range(int(config["vocab_size"]))}
    names = {bos: "<s>"}
    for k, token_id in enumerate(eos_ids):
        names.setdefault(token_id, "</s>" if k == 0 else f"</s{k}>")
    for token_id, text in names.items():
        del vocab[f"w{token_id}"]
        vocab[text] = token_id
    eos_text = names[eos_ids[0]]
    tok = Tokenizer(models.WordLevel(vocab, unk_token=eos_text))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins the words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=names[bos], eos_token=eos_text, unk_token=eos_text)
    out = Path(out_dir)
    if out.exists():
        if any(out.iterdir()) and not (out / MARKER).exists():
            raise FileExistsError(f"{out} exists and was not made by this tool; give an empty or new directory")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    fast.save_pretrained(out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / MARKER).write_text(f"from {config_path}\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("out_dir")
    args = ap.parse_args()
    print(make_dummy_model_dir(args.config, args.out_dir))


if __name__ == "__main__":
    main()
