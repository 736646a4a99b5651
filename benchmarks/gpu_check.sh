#!/usr/bin/env bash
# Every GPU check in one run, for a machine with one CUDA device (`make gpu-check`, or on a bare GPU
# machine whose python3 has torch and transformers: `PY=python3 bash benchmarks/gpu_check.sh`).
# Sized for one H200 inside one 10-minute command: the steps' time limits add up to 9 minutes.
#   1. tests: the gpu-marked tests -- each CUDA kernel's out, lse and gradients as ring blocks against
#      the float64 oracle (cuda_flash with native GQA too), the ring's fused blocks (issue 27), no
#      CUDA sync in steady-state layers of Ulysses, ring and hybrid over a one-rank NCCL group;
#   2. tests-cudnn: cuda_cudnn's gpu tests. Passing (nothing skipped), cuda_cudnn is recorded as verified
#      on this GPU (seqpar.attention.kernel_choice: $SEQPAR_GPU_RECORD, default ~/.cache/seqpar/
#      gpu_verified.json), so `auto` here measures it against cuda_flash; to make it verified everywhere,
#      add it to GPU_VERIFIED in src/seqpar/attention/kernels.py and commit;
#   2b. auto-choice: auto's measured choice at 8k and 32k (32/8 heads, D=128, bf16) for a ring's fused
#      causal, fused full and masked blocks, forward and backward: each candidate's ms, the fastest,
#      the one auto runs (benchmarks/bench_kernels.py --choice);
#   3. ring-step: a ring rank's attention against SDPA alone on the same blocks (goal <= 1.1x), with
#      cuda_flash's repeated K/V and with native GQA (benchmarks/bench_ring_step.py);
#   4. rank-attention, rank-model: one rank of P on this GPU at Llama-3-8B shapes -- attention, a
#      decoder layer and a step: ms, TFLOP/s, MFU, peak memory, bytes per layer (bench_rank.py);
#   5. compile: a step with compiled decoder layers (inductor) against eager, same rank and shapes;
#   6. bench-kernels: the kernels with --opt-in (cuda_cudnn, flex) against dense SDPA.
# It ends with one table: every step's status and time, the kernel ratios, the per-rank rows.
# FULL=1 adds the slower checks (about 18 more minutes): `seqpar train` under torchrun (bf16,
# FSDP2), packed, the longest small-llama3 sequences, train on a GPU host without torchrun, the
# longest sequence on this GPU of two Llama-3-8B layers, seqpar against DeepSpeed's ALST (alst:
# benchmarks/bench_alst.py --device cuda; seqpar alone, saying so, without deepspeed), and
# flex's gpu tests (passing: recorded as verified on this GPU as cuda_cudnn is; add it to GPU_VERIFIED),
# then auto's choice with flex among the candidates (auto-choice-flex).
# Each step's log goes to $LOGS (default /tmp/seqpar-gpu), the runs to $SAVE; the exit status is 1 if
# any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LOGS=${LOGS:-/tmp/seqpar-gpu}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
failed=()
summary=()

step() {  # step NAME SECONDS CMD...: run with a time limit, log to $LOGS/NAME.log
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    echo "=== $name: $*"
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL:-25}" "$LOGS/$name.log"
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || failed+=("$name")
    summary+=("$name|$rc|$((SECONDS - t0))")
    return "$rc"
}

record() {  # record NAME KERNEL: step NAME passed with nothing skipped -> KERNEL is verified on this GPU
    if tail -n 1 "$LOGS/$1.log" | grep -q skipped; then
        echo "=== $2: some of its gpu tests were skipped: not recorded as verified"
        return
    fi
    $PY -c "from seqpar.attention.kernel_choice import record_verified as r; print('=== $2 verified on this GPU:', \
'recorded in', r(['$2']), '(auto measures it here); add it to GPU_VERIFIED in src/seqpar/attention/kernels.py')"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

SAVE=${SAVE:-/tmp/seqpar-gpu-runs}  # the runs' metrics and checkpoints
GPU_TESTS=(tests/attention/test_lse_kernels.py tests/attention/test_cuda_path.py tests/attention/test_fused_blocks.py
           tests/attention/test_kernel_choice.py)
PYTEST=($PY -m pytest -p no:cacheprovider -m gpu -rfEs --tb=short)
TAIL=40 step tests 150 "${PYTEST[@]}" -k "not flex and not cudnn" "${GPU_TESTS[@]}"
TAIL=20 step tests-cudnn 40 "${PYTEST[@]}" -k "cudnn" "${GPU_TESTS[@]}" && record tests-cudnn cuda_cudnn
CHOICE=($PY benchmarks/bench_kernels.py --choice --seq 8192,32768 --heads 32 --kv-heads 8 --dim 128)
TAIL=16 step auto-choice 25 "${CHOICE[@]}" --candidates cuda_flash,cuda_cudnn
step ring-step 30 $PY benchmarks/bench_ring_step.py --seq 32768,131072 --repeats 3
step ring-step-gqa 30 $PY benchmarks/bench_ring_step.py --seq 32768,131072 --repeats 3 --native-gqa
step rank-attention 60 $PY benchmarks/bench_rank.py --what attention --p 2,4,8 --seq 32768,131072 --repeats 2
step rank-model 80 $PY benchmarks/bench_rank.py --what layer,step --p 8 --seq 32768,131072 --max-tokens 16384 \
    --repeats 2
step compile 75 $PY benchmarks/bench_rank.py --what step --strategies ulysses,ring --p 8 --seq 32768 --layers 1 \
    --repeats 2 --compile inductor
step bench-kernels 50 $PY benchmarks/bench_kernels.py --seq 8192 --repeats 2 --opt-in

if [ "${FULL:-0}" = 1 ]; then
    RUN=($PY -m torch.distributed.run --standalone --nproc-per-node 1 -m seqpar.cli.main train --sp 1 --no-progress
         --overwrite)
    step train 150 "${RUN[@]}" --save-dir "$SAVE/run"
    step train-packed 90 "${RUN[@]}" --packing --steps 30 --eval-rows 2 --save-dir "$SAVE/packed"
    for seq in 131072 1048576; do
        step "long-$seq" 150 "${RUN[@]}" --model small-llama3 --seq-len "$seq" --steps 1 --eval-rows 0 \
            --save-dir "$SAVE/long-$seq"
    done
    step train-cpu 60 $PY -m seqpar.cli.main train --steps 2 --seq-len 256 --eval-rows 2 --no-progress --overwrite \
        --save-dir "$SAVE/cpu"
    step rank-1m 150 $PY benchmarks/bench_rank.py --what attention --strategies ring,hybrid --p 8 --seq 1048576 \
        --repeats 1
    TAIL=30 step alst 200 $PY benchmarks/bench_alst.py --device cuda --width llama3-8b --layers 2 --dtype bfloat16 \
        --seq-lens 65536 --limit 262144
    TAIL=40 step tests-flex 420 "${PYTEST[@]}" -k "flex" "${GPU_TESTS[@]}" && record tests-flex flex
    TAIL=16 step auto-choice-flex 240 "${CHOICE[@]}" --candidates cuda_flash,cuda_cudnn,flex
fi

echo
echo "==================================== summary ===================================="
printf '%-16s %-6s %6s  %s\n' step status secs "last line"
for row in "${summary[@]}"; do
    IFS='|' read -r name rc secs <<<"$row"
    printf '%-16s %-6s %6s  %s\n' "$name" "$([ "$rc" = 0 ] && echo pass || echo "FAIL$rc")" "$secs" \
        "$(grep -v '^\s*$' "$LOGS/$name.log" | tail -n 1 | cut -c1-90)"
done
for name in auto-choice auto-choice-flex; do  # S, block, direction, ms per candidate, fastest, auto runs
    [ -f "$LOGS/$name.log" ] && { echo "--- $name"; grep -E '^ *(S|[0-9]+) ' "$LOGS/$name.log"; }
done
for name in ring-step ring-step-gqa; do  # S, sdpa ms, fused ms, rects ms, fused/sdpa, rects/sdpa, blocks
    [ -f "$LOGS/$name.log" ] && { echo "--- $name"; grep -E '^ *(S|[0-9]+) ' "$LOGS/$name.log"; }
done
echo "--- one rank of P (bench_rank.py)"
grep -h -m1 'measured matmul' "$LOGS"/rank-attention.log 2>/dev/null
grep -h -m1 -E '^ +what ' "$LOGS"/rank-attention.log 2>/dev/null
grep -h -E '^ *(attention|layer|step)(\+c)? ' "$LOGS"/rank-*.log "$LOGS"/compile.log 2>/dev/null
echo "failed steps: ${failed[*]:-none}"
[ ${#failed[@]} = 0 ]
