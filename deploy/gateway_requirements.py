"""Print the requirements of a gateway-only install: the project's dependencies less the engine's.

Used by deploy/Dockerfile's `gateway` target (`pip install -r` of what this prints, one a line, then
splitserve itself with --no-deps), so the gateway image carries no torch. Standard library only:
it runs before anything is installed.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

# what only the engine processes (prefill, decode, worker, generate) import; the gateway tokenizes with
# `tokenizers` and jinja2 (splitserve.common.tokenizer)
# (xgrammar imports torch: engine services validate and compile structured output specs)
ENGINE_ONLY = frozenset({"torch", "triton", "safetensors", "ninja", "transformers", "xgrammar"})


def gateway_requirements(pyproject: Path) -> list[str]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if re.split(r"[<>=!~; \[]", d, maxsplit=1)[0].lower() not in ENGINE_ONLY]


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "pyproject.toml"
    print("\n".join(gateway_requirements(path)))
