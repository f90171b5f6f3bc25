#!/usr/bin/env bash
# Install into .venv (reused when present) and start gateway + prefill + decode on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh .venv
exec .venv/bin/splitserve up "$@"
