#!/usr/bin/env bash
# Install the runtime set from the lock into .venv (reused when present; no test or lint tools) and
# start gateway + prefill + decode on loopback: scripts/up.sh [splitserve up options].
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/install.sh .venv
echo "[up] installed in $(( $(date +%s) - start )) s; starting the stack"
exec .venv/bin/splitserve up "$@"
