# Source at the start of a device command, from the checkout's root: installs the carried wheels (.whl/: what the
# GPU image lacks, e.g. fastapi, uvicorn, pydantic, grpcio health/reflection, openai) and this checkout (every part
# of the uv workspace, no deps, no index) into /tmp/site, and puts it first on PYTHONPATH, so
# `python3 -m splitserve.cli ...` and `python3 benchmarks/NAME.py` run the installed package there.
# Fetch the wheels here first: bash benchmarks/gpu_wheels.sh. Without .whl/ only the checkout is installed: enough
# for the engine, the kernels and their benchmarks (the GPU image has torch, triton, grpcio, protobuf).
# Run `python3 -m ...` / `python3 -c ...` with -P (or PYTHONSAFEPATH=1): from the checkout's root its top-level
# folders (kernels/, engine/, common/, tests/) would otherwise shadow packages. The benchmarks set it for the
# processes they start; not exported here, since a benchmark script imports the scripts beside it.
splitserve_parts="./protos ./common ./runtime ./kernels ./engine ./engine_service ./prefill_service ./decode_service
./gateway ./cli ./bench"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "installing .whl/ failed"; return 1; }
fi
# shellcheck disable=SC2086  # one argument a part
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $splitserve_parts . \
    || { echo "installing splitserve failed"; return 1; }
for part in . $splitserve_parts; do rm -rf "$part/build"; done
unset part splitserve_parts
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -P -c "import splitserve.cli, splitserve.gateway.rest, grpc_health.v1; print('splitserve importable')"
else
  python3 -P -c "import splitserve.engine, splitserve.kernels; print('splitserve engine importable (no .whl/)')"
fi
