#!/usr/bin/env bash
# The NIXL wheel for the GPU machine, which lacks it. The wheel (nixl-cu12, the lock's version, for Python 3.12) is
# ~69 MB, more than one run carries beside the working tree (64 MiB in all), so it travels in two parts:
#   here:            bash benchmarks/gpu_nixl.sh split     (gpu_wheels.sh runs it): .whl-nixl/part-0, part-1
#   device, run 1:   carry [".whl-nixl/part-0"], command: bash benchmarks/gpu_nixl.sh stash
#   device, run 2:   carry [".whl-nixl/part-1"], command: bash benchmarks/gpu_nixl.sh stash
#   device, run 3:   carry [".whl"], command: source benchmarks/gpu_setup.sh && bash benchmarks/gpu_nixl.sh install &&
#                    python3 benchmarks/disagg_handoff.py ... --transports cuda_ipc,nccl,nixl
#                    (or python3 benchmarks/nixl_probe.py: which path UCX takes for a READ, per setting)
# `stash` keeps the parts in /tmp/nixl-wheel, which lasts while the machine stays warm (runs back to back);
# `install` joins them, checks the sha256 that uv.lock pins and installs the wheel into /tmp/site (no deps: the
# image has torch and numpy). The CUDA 12 build's UCX needs only the driver (libcuda), not a CUDA 12 runtime.
set -euo pipefail
cd "$(dirname "$0")/.."
parts=.whl-nixl stash=/tmp/nixl-wheel

lock_wheel() {  # "url sha256" of the lock's nixl-cu12 wheel for CPython 3.12
  python3 - <<'PY'
import tomllib
lock = tomllib.load(open("uv.lock", "rb"))
(nixl,) = [p for p in lock["package"] if p["name"] == "nixl-cu12"]
(wheel,) = [w for w in nixl["wheels"] if "-cp312-cp312-manylinux" in w["url"]]
print(wheel["url"], wheel["hash"].removeprefix("sha256:"))
PY
}

case "${1:-}" in
  split)
    read -r url sha < <(lock_wheel)
    exclude=$(git rev-parse --git-path info/exclude)
    grep -qx "/$parts/" "$exclude" 2>/dev/null || echo "/$parts/" >> "$exclude"
    mkdir -p "$parts"
    wheel="$parts/$(basename "$url")"
    [ -f "$wheel" ] || python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 -d "$parts" "nixl-cu12==$(basename "$url" | cut -d- -f2)"
    echo "$sha  $wheel" | sha256sum -c --quiet
    rm -f "$parts"/part-*
    split -n 2 -d -a 1 "$wheel" "$parts/part-"
    ls -l "$parts"
    ;;
  stash)
    mkdir -p "$stash"
    cp "$parts"/part-* "$stash"/
    ls -l "$stash"
    ;;
  install)
    read -r url sha < <(lock_wheel)
    [ -f "$stash/part-0" ] && [ -f "$stash/part-1" ] || { echo "stash both parts first (gpu_nixl.sh stash)"; exit 1; }
    wheel="$stash/$(basename "$url")"
    cat "$stash/part-0" "$stash/part-1" > "$wheel"
    echo "$sha  $wheel" | sha256sum -c --quiet
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheel"
    PYTHONPATH=/tmp/site python3 -P -c "import nixl_cu12._api; print('nixl importable')"
    ;;
  *)
    echo "usage: bash benchmarks/gpu_nixl.sh split | stash | install" >&2
    exit 2
    ;;
esac
