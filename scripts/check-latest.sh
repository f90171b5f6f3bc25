#!/usr/bin/env bash
# Try the newest releases before the lock moves: resolve every dependency anew (as uv.lock's
# settings allow: the CPU torch stays) in a scratch folder, install that set into a scratch virtual
# environment with this checkout, and run lint and the fast suite (no process-starting tests).
#   scripts/check-latest.sh [PYTEST_ARGS...]
# It changes nothing here. When it passes, `scripts/uv.sh lock --upgrade` moves uv.lock forward
# (commit that alone); when it fails, fix the code (or bound the range in pyproject.toml) first.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# the workspace's manifests: the root and every part's pyproject.toml (their metadata is all a lock reads)
cp pyproject.toml README.md uv.lock "$scratch/"
parts=$(python3 -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['tool']['uv']['workspace']['members'])")
for part in $parts; do mkdir -p "$scratch/$part/splitserve/$part" && cp "$part/pyproject.toml" "$scratch/$part/"; done
echo "[check-latest] resolving the newest releases (changes against uv.lock below)"
(cd "$scratch" && bash "$OLDPWD/scripts/uv.sh" lock --upgrade) || { echo "[check-latest] resolution failed"; exit 1; }
echo "[check-latest] installing them into a scratch environment"
(cd "$scratch" && UV_PROJECT_ENVIRONMENT="$scratch/venv" bash "$OLDPWD/scripts/uv.sh" sync --quiet --frozen \
  --extra dev --no-install-workspace --python "${PYTHON:-python3}") || exit 1
editable=(-e .)
for part in $parts; do editable+=(-e "./$part"); done
bash scripts/uv.sh pip install --quiet --python "$scratch/venv/bin/python" --no-deps "${editable[@]}" || exit 1
"$scratch/venv/bin/python" -P -c "import transformers, torch; print('[check-latest] transformers', transformers.__version__, '| torch', torch.__version__)"
bash scripts/lint.sh "$scratch/venv" || { echo "[check-latest] lint failed on the newest releases"; exit 1; }
"$scratch/venv/bin/pytest" -q -p no:cacheprovider -m "not slow" "$@"
rc=$?
echo "[check-latest] finished in $(( $(date +%s) - start )) s (pytest exit code $rc)"
if [ "$rc" -eq 5 ]; then echo "[check-latest] no tests were collected: failing"; exit 1; fi
exit "$rc"
