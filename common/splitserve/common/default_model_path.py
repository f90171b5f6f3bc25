"""Where the embedded default model lives (package data; see docs/default-model.md)."""

from __future__ import annotations

from pathlib import Path


def default_model_path() -> Path:
    """Directory of the bundled Hugging Face model (config.json, model.safetensors, tokenizer)."""
    return Path(__file__).parent / "default_model"
