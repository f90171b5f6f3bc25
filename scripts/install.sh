#!/usr/bin/env bash
# Install splitserve into a virtual environment: scripts/install.sh VENV_DIR [--fresh]
# On a machine without an NVIDIA driver, torch is pinned to the CPU build first so pip
# never pulls a multi-GB CUDA build.
set -euo pipefail
venv=${1:-.venv}
fresh=${2:-}
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if [ "$fresh" = "--fresh" ]; then rm -rf "$venv"; fi
if [ ! -x "$venv/bin/python" ]; then "$py" -m venv "$venv"; fi
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
if ! command -v nvidia-smi >/dev/null 2>&1; then
  "${pip[@]}" "torch==2.13.0"
fi
"${pip[@]}" -e ".[dev]"
# Build the CPU paged-attention op once now (cached per machine) rather than at the first request.
"$venv/bin/python" -c "from splitserve.kernels import cpu_ops as c; m = c.load(); print('CPU ops:', f'built ({m.isa()})' if m else 'unavailable (torch path)')"
