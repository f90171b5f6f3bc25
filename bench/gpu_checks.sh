#!/usr/bin/env bash
# GPU work as device calls of under 10 minutes each; stages 1-2 need `nvidia-h200-x2`, the others run on one
# GPU. Carry .whl (fetched here by `bash bench/gpu_wheels.sh`: what the image lacks, installed with this
# checkout by bench/gpu_setup.sh). Everything printed also
# lands in $OUT/stageN.log, and each bench writes its JSON after every stack, so a call cut short keeps
# what it measured (3 files per stage at most; the device returns 8).
#
#   bash bench/gpu_checks.sh 1   GPU tests of what never ran on a GPU (hardened CUDA IPC handles, the
#                                link keep-alive, the model runner's inputs, --device auto), then the
#                                hand-off, sequential pacing, variants plain and keepalive:2
#   bash bench/gpu_checks.sh 2   sequential keeper:2 (a separate process keeps the link awake: is the link's
#                                sleep what the services pay?), then overlapped pacing, cuda_ipc,
#                                plain and keepalive:2 (pulls while the decode decodes; its ITL shows
#                                what the keep-alive costs)
#   bash bench/gpu_checks.sh 3   the GPU engine's token tests (the model runner's inputs changed), then the
#                                decode-step profile, Llama-3-8B shape, batch 1/64/128 (host time after the
#                                block-table, one-token-input and pickling changes)
#   bash bench/gpu_checks.sh 4   why the services' NCCL send is slower than the probe's: the NCCL probe
#                                stepped from its conditions to the services' (kv_copy_variants
#                                --nccl-set service), then the nccl hand-off under two NCCL settings
#   bash bench/gpu_checks.sh 5   the same probe and the services with NCCL_DEBUG=INFO (what NCCL chose)
#   bash bench/gpu_checks.sh 6   after the NCCL wait fix: GPU tests of the KV connectors (the NCCL receive and its
#                                timeout), the hand-off sequential, both transports, plain and keepalive:2,
#                                and overlapped, nccl, plain and keepalive:2
#   bash bench/gpu_checks.sh 7   one GPU, the new layout and `up`: GPU tests of the engine, the KV I/O and the
#                                runner (installed as splitserve.*), then `splitserve up` with no flags and with
#                                --kv-transport cuda_ipc as a user runs it (bench/up_check.py: ready, the README's
#                                completion, a streamed chat through the openai client, each process's memory)
#   bash bench/gpu_checks.sh 8   one GPU: does a KV pull stall the other streams? bench/pull_stall.py, prefill and
#                                decode processes on cuda:0 over cuda_ipc, Qwen3-0.6B shape (dummy weights),
#                                32 running requests, 2,048-token pulls arriving at 0, 2 and 8 per second
#   bash bench/gpu_checks.sh 9   one GPU: GPU tests of the engine, the core loop and the runner; structured output
#                                on the device (bench/structured_gpu.py); the nano-vllm workload sync vs async
#                                with the device's busy share at the default token budget; the 8B-shape decode
#                                step at batch 1 and 128, sync vs async (issues 17, 18, 20)
#   bash bench/gpu_checks.sh 10  one GPU: every transition of an asynchronous load (the cuda_ipc copy on a side
#                                stream, a decode engine with graphs) and of a send, as the CPU tests run them
set -uo pipefail
stage=${1:?usage: bash bench/gpu_checks.sh 1-10}
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
exec > >(tee "$OUT/stage$stage.log") 2>&1
export PYTHONUNBUFFERED=1
source bench/gpu_setup.sh || { echo "carry .whl (bash bench/gpu_wheels.sh here)"; exit 1; }
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm --format=csv,noheader
git log --oneline -1 2>/dev/null || true

handoff() {  # $1 = seconds allowed, $2 = json name, the rest = flags
    local limit=$1 name=$2
    shift 2
    rm -rf /tmp/disagg-logs
    timeout "$limit" python3 -m bench.disagg_handoff --num-prompts 5 --json "$OUT/$name.json" "$@" 2>&1 \
        | grep -vE "^(cuda_ipc|nccl) [0-9]+ \{"
    echo "keep-alive lines in the decode logs:"
    grep -h "keep-alive\|keeping link" /tmp/disagg-logs/*.log | sed 's/^.*splitserve.kv: //' | sort | uniq -c
}

case $stage in
10)
    timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kv_load_states.py \
        tests/test_kv_send_states.py tests/test_core_loop.py 2>&1 | tail -15
    ;;
9)
    echo "== GPU tests: engine, core loop, runner, sampler"
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_core_loop.py \
        tests/test_model_runner.py tests/test_sampler.py 2>&1 | tail -8
    echo "== structured output on the device"
    timeout 150 python3 -m bench.structured_gpu --device cuda --json "$OUT/structured.json" 2>&1 | tail -22
    echo "== nano-vllm workload, sync vs async, default token budget, device busy share"
    timeout 200 python3 -m bench.offline_throughput --engines splitserve --workload nanovllm \
        --config bench/configs/qwen3-0.6b.json --dtype bfloat16 --device cuda --scheduling sync,async \
        --gpu-busy --json "$OUT/nanovllm.json" 2>&1 | grep -v "^{"
    echo "== 8B-shape decode step, sync vs async"
    timeout 200 python3 -m bench.offline_throughput --workload fixed --engines splitserve \
        --config bench/configs/llama3-8b.json --dtype bfloat16 --device cuda --batch-sizes 1,128 \
        --scheduling sync,async --json "$OUT/fixed.json" 2>&1 | grep -v "^{"
    ;;
8)
    timeout 500 python3 -m bench.pull_stall --transports cuda_ipc --device cuda:0 --dtype bfloat16 \
        --config bench/configs/qwen3-0.6b.json --vocab 150000 --rates 0,2,8 --num-running 32 \
        --running-tokens 6000 --prompt-len 2048 --duration-s 5 --num-kv-blocks 24576 --json "$OUT/pull_stall.json"
    ;;
7)
    echo "== GPU tests"
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_kv_io.py \
        tests/test_model_runner.py 2>&1 | tail -15
    echo "== splitserve up, no flags"
    timeout 300 python3 -m bench.up_check --json "$OUT/up_default.json"
    echo "== splitserve up --kv-transport cuda_ipc"
    timeout 300 python3 -m bench.up_check --json "$OUT/up_cuda_ipc.json" -- --kv-transport cuda_ipc
    ;;
1)
    echo "== GPU tests"
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kv_io.py tests/test_kv_keepalive.py \
        tests/test_model_runner.py 2>&1 | tail -15
    echo "== hand-off, sequential pacing, plain and keepalive:2"
    handoff 330 handoff_sequential --transports cuda_ipc,nccl --variants plain,keepalive:2
    ;;
2)
    echo "== hand-off, sequential pacing, keeper:2"
    handoff 240 handoff_keeper --transports cuda_ipc,nccl --variants keeper:2
    echo "== hand-off, overlapped pacing (64 tokens), cuda_ipc, plain and keepalive:2"
    handoff 280 handoff_overlapped --transports cuda_ipc --pacing overlapped --max-tokens 64 --variants plain,keepalive:2
    ;;
3)
    echo "== GPU engine tests"
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py 2>&1 | tail -8
    echo "== decode-step profile, Llama-3-8B shape"
    timeout 340 python3 -m bench.offline_throughput --workload fixed --engines splitserve --profile \
        --config bench/configs/llama3-8b.json --dtype bfloat16 --device cuda --batch-sizes 1,64,128 \
        --json "$OUT/decode_profile.json" 2>&1 | tail -40
    ;;
4)
    echo "== NCCL probe, from its conditions to the services'"
    timeout 300 python3 -m bench.kv_copy_variants --skip-ipc --nccl-set service --pool-gib 100 \
        --json "$OUT/nccl_probe.json" 2>&1 | grep -v "^NCCL "
    for setting in NCCL_P2P_USE_CUDA_MEMCPY=1 NCCL_P2P_READ_ENABLE=1; do
        echo "== hand-off, sequential, nccl, $setting"
        export "$setting"
        handoff 120 "handoff_${setting%%=*}" --transports nccl
        unset "${setting%%=*}"
    done
    ;;
5)
    echo "== NCCL probe and services with NCCL_DEBUG=INFO: what NCCL chose in each"
    export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P
    timeout 200 python3 -m bench.kv_copy_variants --skip-ipc --nccl-set service --only-variants 0,1,6,7 \
        --pool-gib 100 --json "$OUT/nccl_probe_debug.json" 2>&1 | grep -v "^NCCL "
    export SPLITSERVE_LOG_LEVEL=DEBUG
    handoff 120 handoff_nccl_debug --transports nccl
    grep -h "NCCL INFO.*\(via\|hannel\|version\)" /tmp/disagg-logs/*.log | sed 's/^.*NCCL INFO/NCCL INFO/' \
        | sort | uniq -c | sort -rn | head -40
    grep -h "kv timing" /tmp/disagg-logs/*.log | sed 's/^.*kv timing/kv timing/' | head -20
    ;;
6)
    echo "== GPU tests of the KV connectors"
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kv_io.py 2>&1 | tail -15
    echo "== hand-off, sequential pacing, plain and keepalive:2"
    handoff 240 handoff_sequential --transports nccl,cuda_ipc --variants plain,keepalive:2
    echo "== hand-off, overlapped pacing (64 tokens), nccl, plain and keepalive:2"
    handoff 150 handoff_overlapped --transports nccl --pacing overlapped --max-tokens 64 --variants plain,keepalive:2
    ;;
*)
    echo "stage must be 1-10, got $stage"
    exit 2
    ;;
esac
