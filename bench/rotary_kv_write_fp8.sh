#!/usr/bin/env bash
# The fused rotary + KV write into an fp8 cache on one GPU, in one device call (the bench < 60 s on an H200;
# QUICK=1 bash bench/rotary_kv_write_fp8.sh: bench and kernel tests only):
#   1. install this checkout into /tmp/site (no dependencies; the GPU image has torch and triton; with .whl/
#      carried, bench/gpu_setup.sh)
#   2. python -m bench.rotary_kv_write_fp8: bitwise checks against rotary_embedding + write_kv at the 8B shape
#      (T = 1 and 128, fp8 with scales 0.37/2.5 and 1/1, bf16), graphed times per layer; JSON in $OUT
#   3. the GPU tests of the fused write and of rope_write_attend's fp8 routing (bitwise against the unfused ops)
#   4. (not with QUICK=1) the engine with fp8 weights + KV on the default model: tokens with the fused write and
#      without (tests/test_gpu_engine.py, two engines with graphs: ~1-2 min)
#   then the bench's table again, last. Everything printed also lands in $OUT/rotary_kv_write_fp8.log.
set -uo pipefail
OUT=${OUT:-/tmp/rotary-kv-write-fp8}
mkdir -p "$OUT"
exec > >(tee "$OUT/rotary_kv_write_fp8.log") 2>&1
source bench/gpu_setup.sh || exit 1  # the checkout into /tmp/site (and .whl/ when carried)
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm --format=csv,noheader
echo "=== bench ($(date +%T))"
timeout 120 python3 -m bench.rotary_kv_write_fp8 --json "$OUT/rotary_kv_write_fp8.json" > "$OUT/bench.txt" 2>&1
echo "bench exit $?"
cat "$OUT/bench.txt"
echo "=== tests ($(date +%T))"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_rotary_kv_write.py \
    "tests/test_fused_ops.py::test_fp8_cache_fused_rotary_write_equals_the_unfused_ops" -k "not cpu" 2>&1 | tail -8
if [ -z "${QUICK:-}" ]; then
  echo "=== engine test ($(date +%T))"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py -k fused_rotary_write 2>&1 | tail -8
fi
echo "=== done ($(date +%T)); the bench's table again:"
sed -n '/^   T cache/,$p' "$OUT/bench.txt"
