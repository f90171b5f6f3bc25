#!/usr/bin/env bash
# Build a fresh virtual environment and run the whole test suite.
# pytest's "no tests collected" (exit 5) counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
# tests/test_deploy.py runs a real Prometheus (Debian's package) against the stack
if ! command -v prometheus >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
    || echo "could not install prometheus; tests/test_deploy.py will say how"
fi
bash scripts/install.sh .venv-test --fresh || { echo "install failed"; exit 1; }
echo "install took $(( $(date +%s) - start )) s"
bash scripts/lint.sh .venv-test || { echo "lint failed (scripts/lint.sh)"; exit 1; }
echo "lint passed"
.venv-test/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
rc=$?
echo "suite finished in $(( $(date +%s) - start )) s (pytest exit code $rc)"
if [ "$rc" -eq 5 ]; then echo "no tests were collected: failing"; exit 1; fi
exit "$rc"
