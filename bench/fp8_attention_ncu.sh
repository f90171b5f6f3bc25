#!/usr/bin/env bash
# Why the fp8 paged decode attention reads at 55-60% of the copy rate (issue 19), in one device call (~3 min):
#   1. the split sweep of decode_config's fp8 default ("rows") at the three 8B shapes (bench.fp8_attention
#      --split-sweep: the split heuristic was tuned on bf16 caches, whose programs move twice the bytes)
#   2. Nsight Compute on one launch each of the bf16 kernel and the fp8 default per shape (--probe 1): DRAM
#      throughput, achieved occupancy, warp stall reasons, registers, so the next change aims at what binds:
#      bytes in flight (occupancy x tiles ahead) or instruction issue (conversions, shared-memory round trips)
# ncu runs on the Firecracker machines (nvidia-h200) with --clock-control none (the lease's METHOD.md).
set -uo pipefail
OUT=${OUT:-/tmp/fp8-attention-ncu}
mkdir -p "$OUT"
exec > >(tee "$OUT/fp8_attention_ncu.log") 2>&1
source bench/gpu_setup.sh || exit 1
echo "=== split sweep ($(date +%T))"
timeout 150 python3 -m bench.fp8_attention --split-sweep --json "$OUT/fp8_splits.json" 2>&1 | tail -8
echo "=== ncu ($(date +%T))"
timeout 200 ncu --clock-control none --kernel-name regex:"_decode_kernel|_decode_fp8_kernel" --launch-skip 0 \
    --launch-count 6 --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    --section MemoryWorkloadAnalysis --csv --page details \
    python3 -m bench.fp8_attention --probe 1 --json "$OUT/probe.json" > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
echo "ncu exit $?"
python3 - "$OUT/ncu.csv" <<'PY'
import csv, sys
keep = ("DRAM Throughput", "Memory Throughput", "Duration", "Achieved Occupancy", "Theoretical Occupancy",
        "Registers Per Thread", "Block Limit Registers", "Warp Cycles Per Issued Instruction", "Issue Slots Busy",
        "Stall Long Scoreboard", "Stall Barrier", "Stall MIO Throttle", "Stall Short Scoreboard", "Stall Wait",
        "Stall Math Pipe Throttle", "Stall LG Throttle", "Grid Size", "Waves Per SM")
rows = [r for r in csv.DictReader(line for line in open(sys.argv[1]) if line.startswith('"'))]
for launch in sorted({(r["ID"], r["Kernel Name"]) for r in rows}, key=lambda x: int(x[0])):
    print(f"launch {launch[0]} {launch[1][:40]}")
    for r in rows:
        if (r["ID"], r["Kernel Name"]) == launch and any(r["Metric Name"].startswith(k) for k in keep):
            print(f"    {r['Metric Name']:45s} {r['Metric Value']:>14s} {r['Metric Unit']}")
PY
echo "=== done ($(date +%T))"
