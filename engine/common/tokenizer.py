"""Tokenizer loading from a local Hugging Face directory, and chat templating."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from transformers import AutoTokenizer


def load_tokenizer(path: str | os.PathLike) -> Any:
    """Load the tokenizer saved in model directory `path` (local files only, never the hub).

    Raises FileNotFoundError when the directory does not exist, and ValueError naming the
    directory when transformers cannot build a tokenizer from it.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(
            f"cannot load a tokenizer from {path!r} (expected tokenizer.json or "
            f"tokenizer.model with tokenizer_config.json): {exc}"
        ) from exc


def apply_chat_template(
    tokenizer: Any, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
) -> list[int]:
    """Render chat `messages` ([{"role": ..., "content": ...}]) with the tokenizer's template
    and return the prompt token ids. The template itself writes any BOS token, so the text
    is encoded without adding special tokens again."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"tokenizer {name!r} has no chat template; use a completion request with a "
            "plain prompt, or a model directory whose tokenizer_config.json has chat_template"
        )
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))
