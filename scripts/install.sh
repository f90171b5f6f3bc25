#!/usr/bin/env bash
# Install splitserve from the lock (uv.lock) into a virtual environment, one line per phase:
#   scripts/install.sh VENV_DIR [--dev] [--fresh]
# --dev adds the test and lint tools (the `dev` extra); --fresh starts from an empty environment.
# The lock pins CPython 3.11 on x86-64 Linux with torch's CPU build; elsewhere install from the
# ranges in pyproject.toml (`pip install -e .`, after the torch build for your machine).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
shift || true
extras=() fresh=0
for arg in "$@"; do
  case "$arg" in
    --dev) extras=(--extra dev) ;;
    --fresh) fresh=1 ;;
    *) echo "scripts/install.sh: unknown option $arg (VENV_DIR [--dev] [--fresh])" >&2; exit 2 ;;
  esac
done
start=$(date +%s)
if [ "$fresh" = 1 ]; then rm -rf "$venv"; fi
echo "[install] syncing $venv with uv.lock (${extras[*]:-runtime only})"
# --locked: fail, rather than resolve anew, when pyproject.toml and uv.lock disagree
UV_PROJECT_ENVIRONMENT="$venv" bash scripts/uv.sh sync --locked --python "${PYTHON:-python3}" "${extras[@]}"
echo "[install] building the CPU ops (cached per machine)"
"$venv/bin/python" -P -c "from splitserve.kernels import cpu_ops as c; m = c.load(); print('[install] CPU ops:', f'built ({m.isa()})' if m else 'unavailable (torch path)')"
echo "[install] done in $(( $(date +%s) - start )) s"
