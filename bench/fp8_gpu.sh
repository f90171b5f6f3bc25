#!/usr/bin/env bash
# Issue 19 on one H200, bf16 beside fp8, in one device call (each step bounded; everything printed lands
# in $OUT/fp8.log and each bench writes its JSON under $OUT as it ends, so a call cut short keeps what ran):
#   1. GPU tests of the fp8 KV kernels (Triton write/decode/prefill over e4m3, scales, the activation quantizer),
#      of the W8A16 few-row kernel (8B shapes, split-K bit-stable over repeats, a graph replay) and of Fp8Linear's
#      W8A16 / row-wise _scaled_mm paths against their references
#   2. bench/kernels.py --sections ${FP8_SECTIONS:-fp8}: decode attention bf16 vs fp8 cache against the copy rate
#      (fp8attn), the 8B projections bf16 / W8A8 / W8A16 graphed, with the W8A16 tile sweep (fp8linear)
#   3. 8B-shape decode step, batch 1, 16 and 128: bf16 beside fp8 weights + fp8 KV (offline_throughput --workload
#      fixed) as the engine runs it by default (W8A8 _scaled_mm at every size), fp8 with the W8A16 kernel on
#      (--fp8-w8a16-max-rows 16: splitserve:fp8w8a16) and, after step 2, on the W8A16 tiles its sweep found best
#   4. the nano-vllm workload (Qwen3-0.6B shape): bf16 KV beside fp8 KV
#   5. quality: the default model's held-out perplexity and greedy tokens, bf16 beside fp8
#   6. a disaggregated hand-off on the one GPU over cuda_ipc with fp8 blocks (tokens vs colocated fp8)
# `bash bench/fp8_gpu.sh` runs them all; `bash bench/fp8_gpu.sh 2 3 4` only those steps; the tables of steps 2, 3
# and 5 are printed again side by side at the end (bench/fp8_report.py). The W8A16 kernel (off by default until
# measured) against W8A8 and bf16: projections, decode step and quality, one H200 (its steps' timeouts add up to
# 580 s; never timed whole):
#   FP8_SECTIONS=fp8linear bash bench/fp8_gpu.sh 1 2 3 5
set -uo pipefail
STEPS=${*:-1 2 3 4 5 6}
OUT=${OUT:-/tmp/fp8-gpu}
mkdir -p "$OUT"
exec > >(tee "$OUT/fp8.log") 2>&1
export PYTHONUNBUFFERED=1
source bench/gpu_setup.sh || { echo "carry .whl (bash bench/gpu_wheels.sh here)"; exit 1; }
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm --format=csv,noheader
step() { echo; echo "=== $1 ($(date +%T))"; }
want() { [[ " $STEPS " == *" $1 "* ]]; }

if want 1; then
  step "1 GPU tests"
  timeout 50 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_fp8_kv.py 2>&1 | tail -15
  timeout 50 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_fp8_skinny_linear.py 2>&1 | tail -8
  timeout 30 python3 -m pytest -q -x -p no:cacheprovider tests/test_fp8.py -k on_gpu 2>&1 | tail -5
fi
if want 2; then
  step "2 kernels"
  timeout 110 python3 bench/kernels.py --sections "${FP8_SECTIONS:-fp8}" --json "$OUT/kernels_fp8.json" 2>&1 | tail -110
fi
if want 3; then
  step "3 8B decode step"
  # fp8 = W8A8 at every size (the default), fp8w8a16 = the W8A16 kernel up to 16 rows; with step 2's projection
  # sweep also the kernel on the tiles it found best (splitserve:fp8swept)
  engines=splitserve,splitserve:fp8,splitserve:fp8w8a16
  [[ -s "$OUT/kernels_fp8.json" && "${FP8_SECTIONS:-fp8}" != fp8attn ]] && engines=$engines,splitserve:fp8swept
  timeout 270 python3 -m bench.offline_throughput --workload fixed --engines $engines \
      --config bench/configs/llama3-8b.json --dtype bfloat16 --device cuda --batch-sizes 1,16,128 --output-len 32 \
      --fp8-tiles "$OUT/kernels_fp8.json" --json "$OUT/fixed_fp8.json" 2>&1 | grep -v "^{" | tail -30
fi
if want 4; then
  step "4 nano-vllm workload"
  timeout 110 python3 -m bench.offline_throughput --workload nanovllm --engines splitserve,splitserve:fp8kv \
      --config bench/configs/qwen3-0.6b.json --dtype bfloat16 --device cuda --max-num-seqs 256 \
      --max-num-batched-tokens 8192 --json "$OUT/nanovllm_fp8.json" 2>&1 | tail -6
fi
if want 5; then
  step "5 quality"
  timeout 70 python3 -m bench.fp8_quality --device cuda --variants "bf16,fp8 kv,fp8 w8a16+kv,fp8 w8a8+kv,float32" \
      --json "$OUT/quality.json" 2>&1 | tail -10
fi
if want 6; then
  step "6 disaggregated cuda_ipc hand-off, fp8 KV"
  timeout 100 python3 -m bench.disagg_handoff --config bench/configs/qwen3-0.6b.json --prefill-device cuda:0 \
      --decode-device cuda:0 --transports cuda_ipc --kv-cache-dtype fp8 --num-prompts 3 --prompt-len 2048 \
      --num-kv-blocks 1024 --logs /tmp/disagg-logs --json "$OUT/disagg_fp8.json" 2>&1 | tail -8
fi
step "tables side by side"
python3 -m bench.fp8_report "$OUT"
step "done"
