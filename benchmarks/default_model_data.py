"""Corpus and tokenizer for splitserve's embedded default model.

The corpus is the Python standard library's own ``.py`` source (code, comments and
docstrings) as shipped with the interpreter that runs this module, so every machine can
rebuild it offline. Files are read in sorted order of their path relative to the stdlib
root; every ``HELDOUT_EVERY``-th file (index % HELDOUT_EVERY == HELDOUT_OFFSET) is held
out and never used for the tokenizer, the training tokens or the unigram table.

Training text also carries a small set of chat turns built from the training files'
docstrings (``What does `json.dumps` do?`` -> signature + first docstring paragraph), in
exactly the format of the chat template shipped with the tokenizer, so the model answers
something sensible when served behind a chat endpoint.

The standard library differs between Python versions; tests therefore use the committed
held-out slice (tests/data/heldout.txt), never a regenerated one.
"""

from __future__ import annotations

import ast
import inspect
import json
import random
import sys
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [EOS, SYSTEM, USER, ASSISTANT]  # ids 0..3, in this order
HELDOUT_EVERY = 20
HELDOUT_OFFSET = 7
MIN_DOC_CHARS = 20  # shorter docstrings ("Stub.") make useless chat answers
SYSTEM_PROMPT = "You are a helpful assistant who knows the Python standard library."

# Jinja chat template: each turn is "<|role|>\n{content}<|endoftext|>\n"; the generation
# prompt is "<|assistant|>\n". `render_chat` below must produce the identical string.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|endoftext|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{%- endif %}"
)


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Python twin of CHAT_TEMPLATE (used to build training chat turns)."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}{EOS}\n" for m in messages)
    return text + (f"{ASSISTANT}\n" if add_generation_prompt else "")


@dataclass(frozen=True)
class SourceFile:
    """One stdlib file: its path relative to the stdlib root and its UTF-8 text."""

    rel_path: str
    text: str


def default_stdlib_dir() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(stdlib_dir: Path) -> list[SourceFile]:
    """All non-empty, UTF-8 ``.py`` files under stdlib_dir except site-packages, sorted by path."""
    files = []
    for path in sorted(stdlib_dir.rglob("*.py"), key=lambda p: p.relative_to(stdlib_dir).as_posix()):
        rel = path.relative_to(stdlib_dir)
        if "site-packages" in rel.parts or not path.is_file():
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue  # a handful of test files are deliberately in other encodings
        if text.strip():
            files.append(SourceFile(rel.as_posix(), text))
    return files


def split_files(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, heldout): every HELDOUT_EVERY-th file, starting at HELDOUT_OFFSET, is held out."""
    train = [f for i, f in enumerate(files) if i % HELDOUT_EVERY != HELDOUT_OFFSET]
    heldout = [f for i, f in enumerate(files) if i % HELDOUT_EVERY == HELDOUT_OFFSET]
    return train, heldout


def is_test_path(rel_path: str) -> bool:
    parts = rel_path.split("/")
    return any(p in ("test", "tests", "idle_test") for p in parts[:-1])


def module_name(rel_path: str) -> str:
    """'email/mime/text.py' -> 'email.mime.text'; 'json/__init__.py' -> 'json'."""
    parts = rel_path[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _question(full_name: str, kind: str) -> str:
    templates = [
        "What does `{n}` do?",
        "Explain `{n}`.",
        "How do I use `{n}`?",
        "Describe the {k} `{n}` from the Python standard library.",
    ]
    return templates[zlib.crc32(full_name.encode()) % len(templates)].format(n=full_name, k=kind)


def _answer(node: ast.AST, full_name: str, doc: str) -> str:
    paragraphs = [p.strip() for p in doc.split("\n\n") if p.strip()]
    body = paragraphs[0]
    for p in paragraphs[1:]:
        if len(body) + len(p) > 600:
            break
        body += "\n\n" + p
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return f"`{full_name}({ast.unparse(node.args)})`\n\n{body}"
    return f"`{full_name}` is a class.\n\n{body}"


def chat_examples(files: list[SourceFile]) -> list[str]:
    """Chat turns (rendered with render_chat) from public docstrings of non-test files."""
    examples = []
    for f in files:
        mod = module_name(f.rel_path)
        if is_test_path(f.rel_path) or any(p.startswith("_") for p in mod.split(".")):
            continue  # tests and private modules make poor answers
        try:
            tree = ast.parse(f.text)
        except (SyntaxError, ValueError):
            continue
        for node, qual in _documented_defs(tree):
            full = f"{mod}.{qual}"
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            messages = []
            if zlib.crc32(full.encode()) % 3 == 0:
                messages.append({"role": "system", "content": SYSTEM_PROMPT})
            messages.append({"role": "user", "content": _question(full, kind)})
            doc = inspect.cleandoc(ast.get_docstring(node, clean=False))
            messages.append({"role": "assistant", "content": _answer(node, full, doc)})
            examples.append(render_chat(messages))
    return examples


def _documented_defs(tree: ast.Module):
    """Yield (node, qualname) for public top-level defs/classes and their public methods."""
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for node in tree.body:
        if not isinstance(node, defs) or node.name.startswith("_"):
            continue
        if len(ast.get_docstring(node) or "") >= MIN_DOC_CHARS:
            yield node, node.name
        if isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, defs) and not sub.name.startswith("_"):
                    if len(ast.get_docstring(sub) or "") >= MIN_DOC_CHARS:
                        yield sub, f"{node.name}.{sub.name}"


def training_documents(train_files: list[SourceFile], seed: int = 0) -> list[str]:
    """File texts plus chat examples, in a deterministic shuffled order."""
    docs = [f.text for f in train_files] + chat_examples(train_files)
    random.Random(seed).shuffle(docs)
    return docs


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization, no prefix space) with SPECIAL_TOKENS first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, f"special token {t} got id {tok.token_to_id(t)}, want {i}"
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json + tokenizer_config.json (with CHAT_TEMPLATE) for AutoTokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        # The generic fast tokenizer keeps tokenizer.json as written; a model-specific
        # class could rebuild the pre-tokenizer (see PITFALLS.md on qwen2).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "additional_special_tokens": [SYSTEM, USER, ASSISTANT],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def heldout_slice(heldout: list[SourceFile], max_chars: int, max_file_chars: int) -> str:
    """Whole held-out non-test files, each followed by EOS, in order, up to max_chars total."""
    out, total = [], 0
    for f in heldout:
        if is_test_path(f.rel_path) or len(f.text) > max_file_chars:
            continue
        if total + len(f.text) > max_chars:
            break
        out.append(f.text + EOS)
        total += len(f.text)
    return "".join(out)


def encode_stream(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    """Token ids of all docs, each followed by EOS, as one uint16 stream."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    assert tok.get_vocab_size() <= 65536, "uint16 token files need vocab_size <= 65536"
    return np.asarray(ids, dtype=np.uint16)


def prepare(out_dir: Path, stdlib_dir: Path | None, model_config: dict, heldout_txt: Path, unigram_json: Path) -> dict:
    """Build everything the GPU step needs under out_dir, plus the committed test data.

    Writes out_dir/{train.bin, heldout.bin, model_config.json, corpus.json, tokenizer/},
    heldout_txt (committed held-out slice) and unigram_json (token counts of train.bin, the
    unigram baseline the tests compare the model against). Returns the corpus summary.
    """
    stdlib_dir = stdlib_dir or default_stdlib_dir()
    train_files, heldout_files = split_files(list_source_files(stdlib_dir))
    docs = training_documents(train_files)
    tok = train_tokenizer(docs, model_config["vocab_size"])
    save_tokenizer(tok, out_dir / "tokenizer", model_config["max_position_embeddings"])
    train_ids = encode_stream(tok, docs)
    heldout_ids = encode_stream(tok, [f.text for f in heldout_files])
    train_ids.tofile(out_dir / "train.bin")
    heldout_ids.tofile(out_dir / "heldout.bin")
    (out_dir / "model_config.json").write_text(json.dumps(model_config, indent=2) + "\n")
    heldout_txt.parent.mkdir(parents=True, exist_ok=True)
    heldout_txt.write_text(heldout_slice(heldout_files, max_chars=200_000, max_file_chars=40_000))
    counts = np.bincount(train_ids, minlength=tok.get_vocab_size())
    unigram_json.write_text(
        json.dumps({"source": "token counts of the training stream (train.bin)", "counts": counts.tolist()}) + "\n"
    )
    summary = {
        "python": sys.version.split()[0],
        "stdlib_dir": str(stdlib_dir),
        "train_files": len(train_files),
        "heldout_files": len(heldout_files),
        "train_docs": len(docs),
        "chat_examples": len(docs) - len(train_files),
        "train_chars": sum(len(d) for d in docs),
        "heldout_chars": sum(len(f.text) for f in heldout_files),
        "train_tokens": int(train_ids.size),
        "heldout_tokens": int(heldout_ids.size),
        "vocab_size": tok.get_vocab_size(),
    }
    (out_dir / "corpus.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return summary
