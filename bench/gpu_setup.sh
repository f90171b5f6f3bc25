# Source at the start of a device command: installs the carried wheels (.whl/: what the GPU image lacks,
# e.g. fastapi, uvicorn, pydantic, grpcio health/reflection, openai) and this checkout (no deps, no index)
# into /tmp/site, and puts it first on PYTHONPATH, so `python3 -m splitserve.cli ...` runs there.
# Fetch the wheels here first: bash bench/gpu_wheels.sh. Without .whl/ only the checkout is installed: enough
# for the engine, the kernels and their benches (the GPU image has torch, triton, grpcio, protobuf).
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "installing .whl/ failed"; return 1; }
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --target /tmp/site . \
    || { echo "installing splitserve failed"; return 1; }
rm -rf build
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -c "import splitserve.cli, splitserve.gateway.rest, grpc_health.v1; print('splitserve importable')"
else
  python3 -c "import splitserve.engine, splitserve.kernels; print('splitserve engine importable (no .whl/: no gateway)')"
fi
