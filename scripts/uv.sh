#!/usr/bin/env bash
# Run the lock tool: scripts/uv.sh ARGS... is `uv ARGS...` with the uv that uv.lock pins.
# The first call installs that version (hash-checked, from PyPI) into .tools/uv-VERSION/.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
requirement=$("$py" - "$root/uv.lock" <<'PY'
import sys, tomllib
lock = tomllib.load(open(sys.argv[1], "rb"))
(uv,) = [p for p in lock["package"] if p["name"] == "uv"]
print(f"uv=={uv['version']}", *(f"--hash={w['hash']}" for w in uv["wheels"]))
PY
)
version=${requirement%% *}
tools="$root/.tools/${version/==/-}"
if [ ! -x "$tools/bin/uv" ]; then
  echo "installing ${version} (the lock tool) into ${tools#"$root"/}" >&2
  rm -rf "$tools"
  "$py" -m venv "$tools"
  echo "$requirement" >"$tools/requirements.txt"
  "$tools/bin/python" -m pip install -qq --disable-pip-version-check --require-hashes \
    -r "$tools/requirements.txt" >&2
fi
# uv never downloads a Python of its own here: the tested set runs on the machine's python3.
export UV_PYTHON_DOWNLOADS=never
exec "$tools/bin/uv" "$@"
