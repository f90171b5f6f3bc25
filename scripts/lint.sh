#!/usr/bin/env bash
# Style and layer rules: ruff (lint + format) and import-linter's contracts (pyproject.toml).
# scripts/lint.sh [VENV_DIR]  (default .venv-test; scripts/test.sh runs it before the tests)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(cd "${1:-.venv-test}" && pwd)
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
# lint-imports walks the files of the installed `splitserve`; an editable install maps the folders
# through an import hook that file walk cannot see, so it reads a plain install of this tree.
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
  --no-build-isolation --target "$root/site" . >"$root/pip.log" 2>&1 || { cat "$root/pip.log"; exit 1; }
rm -rf build  # setuptools' staging folder
(cd "$root" && PYTHONPATH="$root/site" "$venv/bin/lint-imports" --no-cache "$OLDPWD/pyproject.toml")
