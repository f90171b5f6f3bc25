#!/usr/bin/env bash
# Why the fp8 paged decode attention reads at 55-60% of the copy rate (issue 19), in one device call (~5 min):
#   1. the split sweep of decode_config's fp8 default ("rows") at the three 8B shapes (bench.fp8_attention
#      --split-sweep: the split heuristic was tuned on bf16 caches, whose programs move twice the bytes)
#   2. Nsight Compute on one launch each of the bf16 kernel and the fp8 default per shape (--probe 1): DRAM
#      throughput, achieved occupancy, warp stall reasons, registers, so the next change aims at what binds:
#      bytes in flight (occupancy x tiles ahead), instruction issue (conversions, shared-memory round trips), or
#      DRAM locality: at fp8 a (token, head) row is one 128-byte run, half the bf16 cache's, so steps 1-2 run
#      again on a head-major copy of the cache (--head-major: a head's 16 tokens of a block in one 2 KiB run)
# ncu runs on the Firecracker machines (nvidia-h200) with --clock-control none (the lease's METHOD.md); it skips the
# three launches of the reference outputs, then profiles the probe's six (bf16, fp8 per shape).
set -uo pipefail
OUT=${OUT:-/tmp/fp8-attention-ncu}
mkdir -p "$OUT"
exec > >(tee "$OUT/fp8_attention_ncu.log") 2>&1
source bench/gpu_setup.sh || exit 1
STALLS=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' long_scoreboard short_scoreboard \
    lg_throttle mio_throttle math_pipe_throttle wait barrier not_selected selected dispatch_stall no_instruction \
    branch_resolving drain membar imc_miss tex_throttle sleeping); STALLS=${STALLS%,}
for layout in "" --head-major; do
  tag=${layout:-engine-layout}; tag=${tag#--}
  echo "=== split sweep, $tag ($(date +%T))"
  timeout 100 python3 -m bench.fp8_attention --split-sweep $layout --json "$OUT/fp8_splits_$tag.json" 2>&1 | tail -7
  echo "=== ncu, $tag ($(date +%T))"
  timeout 120 ncu --clock-control none --kernel-name regex:"_decode_kernel|_decode_fp8_kernel" --launch-skip 3 --launch-count 6 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
      --section MemoryWorkloadAnalysis --metrics "$STALLS,smsp__inst_executed.sum,dram__bytes_read.sum" \
      --csv --page details \
      python3 -m bench.fp8_attention --probe 1 $layout --json "$OUT/probe_$tag.json" > "$OUT/ncu_$tag.csv" \
      2> "$OUT/ncu_$tag.err"
  echo "ncu exit $?"
  python3 bench/ncu_summary.py "$OUT/ncu_$tag.csv"
done
echo "=== done ($(date +%T))"
