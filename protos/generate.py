"""Regenerate the committed stubs: `python -m protos.generate [OUT_DIR]`."""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_FILES = ("common", "generation", "prefill", "decode")
REPO_ROOT = Path(__file__).resolve().parent.parent


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every .proto; outputs land in out_dir/protos/. Returns the written files."""
    from grpc_tools import protoc

    (out_dir / "protos").mkdir(parents=True, exist_ok=True)
    sources = [f"protos/{name}.proto" for name in PROTO_FILES]
    args = ["protoc", f"-I{REPO_ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *sources]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {sources}")
    return sorted((out_dir / "protos").glob("*_pb2*.py*"))


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT
    for path in generate(target):
        print(path)
