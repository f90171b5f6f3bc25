#!/usr/bin/env bash
# Style and layer rules: ruff (lint + format) and import-linter's contracts (pyproject.toml), the
# contracts read from the source tree: every part's folder (the workspace's members) on the path.
# scripts/lint.sh [VENV_DIR]  (default .venv-test; scripts/test.sh runs it before the tests)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(cd "${1:-.venv-test}" && pwd)
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
parts=$("$venv/bin/python" -P -c "
import tomllib
members = tomllib.load(open('pyproject.toml', 'rb'))['tool']['uv']['workspace']['members']
print(':'.join(members))")
PYTHONPATH="$parts" "$venv/bin/lint-imports" --no-cache
