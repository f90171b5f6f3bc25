#!/usr/bin/env bash
# The GPU work queued on CPU-only sessions, as two device calls of under 10 minutes each on
# `nvidia-h200-x2` (docs/perf.md, "Next: keep the link awake"). Results go to $OUT (8 files at most).
#
#   bash bench/gpu_checks.sh 1   GPU tests of what never ran on a GPU (hardened CUDA IPC handles,
#                                the link keep-alive, the model runner's inputs, the GPU engine), then
#                                the hand-off with every keep-awake variant, sequential pacing
#   bash bench/gpu_checks.sh 2   the same variants with overlapped pacing (pulls while the decode
#                                decodes; its ITL shows what the keep-alive costs), then the decode-step
#                                profile at batch 1/64/128 (host time after the block-table change)
#
# Carry gpu_carry/wheels (grpcio health/reflection for the image's grpcio).
set -uo pipefail
stage=${1:?usage: bash bench/gpu_checks.sh 1|2}
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-index gpu_carry/wheels/*.whl >/dev/null 2>&1 \
    || echo "note: gpu_carry/wheels not installed (carry it)"
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm --format=csv,noheader
git log --oneline -1 2>/dev/null || true

variants="plain,keeper:2,keeper:20,keepalive:2"
handoff() {  # $1 = json name, the rest = extra flags
    local name=$1
    shift
    rm -rf /tmp/disagg-logs
    python3 -m bench.disagg_handoff --transports cuda_ipc,nccl --num-prompts 5 --json "$OUT/$name.json" "$@" 2>&1 \
        | grep -vE "^(cuda_ipc|nccl)[ a-z:0-9.]* [0-9]+ \{" | tail -20
    echo "decode logs, keep-alive lines:"
    grep -h "keep-alive\|keeping link" /tmp/disagg-logs/*.log | sed 's/^.*splitserve.kv[^ ]* //' | sort | uniq -c
}

case $stage in
1)
    echo "== GPU tests"
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kv_io.py tests/test_kv_keepalive.py \
        tests/test_model_runner.py tests/test_gpu_engine.py 2>&1 | tail -15
    echo "== hand-off, sequential pacing, variants $variants"
    handoff handoff_sequential --variants "$variants"
    ;;
2)
    echo "== hand-off, overlapped pacing (64 tokens), variants plain,keepalive:2"
    handoff handoff_overlapped --pacing overlapped --max-tokens 64 --variants plain,keepalive:2
    echo "== decode-step profile, Llama-3-8B shape"
    python3 -m bench.offline_throughput --workload fixed --engines splitserve --profile \
        --config bench/configs/llama3-8b.json --dtype bfloat16 --device cuda --batch-sizes 1,64,128 \
        --json "$OUT/decode_profile.json" 2>&1 | tail -40
    ;;
*)
    echo "stage must be 1 or 2, got $stage" >&2
    exit 2
    ;;
esac
