"""Regenerate the committed stubs: `python -m splitserve.protos.generate [OUT_DIR]`.

The .proto files import each other as `splitserve/protos/NAME.proto`, the path they have inside
the installed package, so the generated modules import `from splitserve.protos import ...` and
register their descriptors under that unique path. protoc runs on a staging copy laid out that way
(`STAGING/splitserve/protos/*.proto`), since the repository keeps them in `protos/`.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_FILES = ("common", "generation", "prefill", "decode")
PROTO_DIR = Path(__file__).resolve().parent


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every .proto; the stubs are written to out_dir. Returns the written files."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "src" / "splitserve" / "protos"
        staged.mkdir(parents=True)
        for name in PROTO_FILES:
            shutil.copy(PROTO_DIR / f"{name}.proto", staged / f"{name}.proto")
        gen = Path(tmp) / "gen"
        gen.mkdir()
        sources = [f"splitserve/protos/{name}.proto" for name in PROTO_FILES]
        args = [
            "protoc",
            f"-I{Path(tmp) / 'src'}",
            f"--python_out={gen}",
            f"--pyi_out={gen}",
            f"--grpc_python_out={gen}",
            *sources,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {sources}")
        written = []
        for path in sorted((gen / "splitserve" / "protos").glob("*_pb2*.py*")):
            target = out_dir / path.name
            shutil.copy(path, target)
            written.append(target)
        return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR
    for path in generate(target):
        print(path)
