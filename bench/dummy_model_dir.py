"""A model directory for dummy-weight benchmarks: a bench config plus a word-level tokenizer that
covers the whole vocabulary (token i is the word "w<i>"), so the gateway can tokenize, detokenize
and check stop strings for a model shape that has no tokenizer of its own (e.g. the Llama-3-8B one).

    python -m bench.dummy_model_dir bench/configs/llama3-8b.json /tmp/llama3-8b-dummy

Serve it with `--model /tmp/llama3-8b-dummy --load-format dummy` (engines and gateway alike).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def make_dummy_model_dir(config_path: str | Path, out_dir: str | Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = json.loads(Path(config_path).read_text())
    vocab_size = int(config["vocab_size"])
    bos, eos = int(config.get("bos_token_id", 1)), int(config.get("eos_token_id", 2))
    vocab = {f"w{i}": i for i in range(vocab_size)}
    special = {bos: "<s>", eos: "</s>"}
    for token_id, text in special.items():
        del vocab[f"w{token_id}"]
        vocab[text] = token_id
    tok = Tokenizer(models.WordLevel(vocab, unk_token=special[eos]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="</s>")
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    fast.save_pretrained(out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("out_dir")
    args = ap.parse_args()
    print(make_dummy_model_dir(args.config, args.out_dir))


if __name__ == "__main__":
    main()
