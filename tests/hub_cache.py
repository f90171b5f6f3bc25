"""A Hugging Face hub cache laid out on disk by hand (no network), as huggingface_hub writes one:

<cache>/models--org--name/
    blobs/<sha256 of a file>          the bytes
    refs/main                         the commit a branch points at
    snapshots/<commit>/<file>         -> ../../blobs/<sha256>
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from splitserve.common.default_model_path import default_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_snapshot(cache: Path, repo_id: str, files_dir: Path = None, commit: str = COMMIT, refs=("main",)) -> Path:
    """Put `files_dir`'s files (the default model's) in `cache` as `repo_id` at `commit`, with each name in
    `refs` pointing at it; the snapshot's directory."""
    files_dir = Path(files_dir or default_model_path())
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(files_dir.iterdir()):
        if not f.is_file():
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
