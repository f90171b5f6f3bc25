"""Tuned launch configs as data, read by one loader.

One JSON file per op, device and weight/activation types under `configs/`, named as vLLM names its kernel
configs: `<op>,device_name=<torch.cuda.get_device_name with spaces as _>,dtype=<dtype>.json`. A file maps a
launch mode ("gemv": one row, "dot": a few rows) to shapes ("N=<rows of W>,K=<columns>") and their launch
parameters. A device without a file gets {} and the kernel's own choice. The sweeps that write these files
are in the repository's benchmarks (docs/performance.md says which numbers chose them).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

CONFIG_DIR = Path(__file__).with_name("configs")
_SHAPE = re.compile(r"N=(\d+),K=(\d+)")


def config_path(op: str, device_name: str, dtype: str) -> Path:
    return CONFIG_DIR / f"{op},device_name={device_name.replace(' ', '_')},dtype={dtype}.json"


@functools.cache
def tuned_configs(op: str, device_name: str, dtype: str) -> dict[str, dict[tuple[int, int], dict]]:
    """{mode: {(N, K): launch parameters}} of `op` on `device_name` for `dtype`; {} where none was tuned."""
    path = config_path(op, device_name, dtype)
    if not path.exists():
        return {}
    tables = json.loads(path.read_text())
    return {mode: {_shape(key): config for key, config in table.items()} for mode, table in tables.items()}


def _shape(key: str) -> tuple[int, int]:
    match = _SHAPE.fullmatch(key)
    if match is None:
        raise ValueError(f"tuned config key {key!r} is not 'N=<int>,K=<int>'")
    return int(match.group(1)), int(match.group(2))
