#!/usr/bin/env bash
# FP8 paged decode attention variants on one GPU, in one device call (< 5 min on an H200):
#   1. install this checkout into /tmp/site (no dependencies; the GPU image has torch and triton)
#   2. python -m bench.fp8_attention --cudagraph: every variant's error against the bf16 kernel and its time
#      (replayed from CUDA graphs, as the engine's decode steps) at the three Llama-3-8B shapes, a tile sweep of
#      the Triton variants, the mma kernel's warp counts, the table last; JSON in $OUT/fp8_attention.json
#   3. the variant tests compiled for the GPU (tests/kernels/test_fp8_decode_variants.py,
#      test_fp8_mma_decode.py), after the bench so that slow compiles cannot starve it; then the table again
# Everything printed also lands in $OUT/fp8_attention.log. A confirm run: CONFIGS='<the JSON a run printed after
# "best config per variant">' bash bench/fp8_attention.sh (those configs only, beside the baselines).
set -uo pipefail
OUT=${OUT:-/tmp/fp8-attention}
mkdir -p "$OUT"
exec > >(tee "$OUT/fp8_attention.log") 2>&1
source bench/gpu_setup.sh || exit 1  # the checkout into /tmp/site (and .whl/ when carried)
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm --format=csv,noheader
echo "=== bench ($(date +%T))"
timeout 240 python3 -m bench.fp8_attention --cudagraph --budget-s "${BUDGET_S:-150}" --json "$OUT/fp8_attention.json" \
    ${CONFIGS:+--configs "$CONFIGS"}
echo "=== tests ($(date +%T))"
for f in tests/kernels/test_fp8_decode_variants.py tests/kernels/test_fp8_mma_decode.py; do
  echo "$f: $(timeout 90 python3 -m pytest -q -p no:cacheprovider "$f" 2>&1 | tail -1)"
done
echo "=== done ($(date +%T)); the bench's table again:"
python3 -m bench.fp8_attention --table-from "$OUT/fp8_attention.json"
