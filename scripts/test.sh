#!/usr/bin/env bash
# Build a fresh virtual environment from the lock (uv.lock) and run the whole suite: lint, the layer
# contracts, the tests. pytest's "no tests collected" (exit 5) counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
# tests/test_deploy.py runs a real Prometheus (Debian's package) against the stack
if ! command -v prometheus >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "[test] installing Debian's prometheus for tests/test_deploy.py"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
    || echo "[test] could not install prometheus; tests/test_deploy.py will say how"
fi
bash scripts/install.sh .venv-test --dev --fresh || { echo "install failed"; exit 1; }
echo "[test] installed in $(( $(date +%s) - start )) s"
# Every process the suite starts (services, their engine cores, CLIs: hundreds) imports torch and transformers.
# Where bytecode may not be written (PYTHONDONTWRITEBYTECODE, common in CI images and containers) each one compiled
# their sources again: about 4 s of CPU per engine core, 2 s per service. Cache it once, in the fresh venv, out of
# the checkout's folders.
export PYTHONPYCACHEPREFIX="$PWD/.venv-test/pycache"
unset PYTHONDONTWRITEBYTECODE
.venv-test/bin/python -P -c "import transformers, torch, importlib.metadata as m; print('[test] transformers', transformers.__version__, '| kernels', m.version('kernels'), '| torch', torch.__version__)"
bash scripts/lint.sh .venv-test || { echo "lint failed (scripts/lint.sh)"; exit 1; }
echo "[test] lint passed"
# the pytest script, not `python -m pytest`, which would put the working directory first on sys.path
.venv-test/bin/pytest -q -p no:cacheprovider --durations=25 "$@"
rc=$?
echo "suite finished in $(( $(date +%s) - start )) s (pytest exit code $rc)"
if [ "$rc" -eq 5 ]; then echo "no tests were collected: failing"; exit 1; fi
exit "$rc"
