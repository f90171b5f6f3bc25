#!/usr/bin/env bash
# Download, here, the wheels the GPU image lacks into .whl/ (git-ignored; carry it: benchmarks/gpu_setup.sh
# installs them there). Versions match the GPU image: Python 3.12, grpcio 1.84.0. fastapi itself needs
# opentelemetry-api (its telemetry module), so that comes along; the SDK and exporter do not (tracing is off).
# xgrammar (structured output) needs apache-tvm-ffi; its other requirements (torch, transformers, pydantic,
# numpy, typing-extensions) are in the image or in this list. The NIXL wheel (--kv-transport nixl) is too large to
# travel with the others: gpu_nixl.sh splits it into two parts carried by runs of their own (its header says how).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)  # .git is a file in a worktree: ask git where its exclude is
mkdir -p "$(dirname "$exclude")"
grep -qx "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"
mkdir -p .whl
for pkg in fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 annotated-doc==0.0.7 uvicorn==0.54.0 grpcio-health-checking==1.84.0 \
    grpcio-reflection==1.84.0 openai==3.57.0 jiter==0.19.0 sniffio==1.3.1 distro==1.9.0 opentelemetry-api==1.45.2 \
    httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$pkg"
done
ls .whl
bash benchmarks/gpu_nixl.sh split
