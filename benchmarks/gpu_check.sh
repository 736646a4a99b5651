#!/usr/bin/env bash
# Every GPU check in one run, for a machine with one CUDA device (`make gpu-check`, or on a bare GPU
# machine whose python3 has torch and transformers: `PY=python3 bash benchmarks/gpu_check.sh`):
#   1. the gpu-marked tests: each CUDA kernel's out, lse and gradients as ring blocks against the
#      float64 oracle; no CUDA sync (set_sync_debug_mode("error")) in steady-state layers of
#      Ulysses, ring and hybrid over a one-rank NCCL group (the opt-in kernels, flex and cuda_cudnn,
#      last: their tests and their bench_kernels figures);
#   2. `seqpar train` under torchrun with NCCL (bf16, FSDP2, sharded init) on its default task;
#   3. `seqpar train` without torchrun on a GPU host (it must say that it runs on the CPU);
#   4. the kernels' time and memory against dense SDPA (benchmarks/bench_kernels.py);
#   5. the longest sequence of the small-llama3 shape on the GPU at sp=1 (tiled loss, tiled MLP,
#      checkpointed layers).
# Each step's log goes to $LOGS (default /tmp/seqpar-gpu), the runs to $SAVE; the exit status is 1 if
# any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LOGS=${LOGS:-/tmp/seqpar-gpu}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
failed=()

step() {  # step NAME SECONDS CMD...: run with a time limit, log to $LOGS/NAME.log
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    echo "=== $name: $*"
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL:-25}" "$LOGS/$name.log"
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || failed+=("$name")
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

SAVE=${SAVE:-/tmp/seqpar-gpu-runs}  # the runs' metrics and checkpoints
RUN=($PY -m torch.distributed.run --standalone --nproc-per-node 1 -m seqpar.cli.main train --sp 1 --no-progress --overwrite)
GPU_TESTS=(tests/attention/test_lse_kernels.py tests/attention/test_cuda_path.py)
TAIL=40 step tests 240 $PY -m pytest -p no:cacheprovider -m gpu -v -rfEs --tb=short -k "not flex and not cudnn" \
    "${GPU_TESTS[@]}"
step train 150 "${RUN[@]}" --save-dir "$SAVE/run"
step bench-kernels 120 $PY benchmarks/bench_kernels.py --seq 8192,32768 --repeats 3
step train-packed 90 "${RUN[@]}" --packing --steps 30 --eval-rows 2 --save-dir "$SAVE/packed"
for seq in 131072 1048576; do
    step "long-$seq" 150 "${RUN[@]}" --model small-llama3 --seq-len "$seq" --steps 1 --eval-rows 0 \
        --save-dir "$SAVE/long-$seq"
done
step train-cpu 60 $PY -m seqpar.cli.main train --steps 2 --seq-len 256 --eval-rows 2 --no-progress --overwrite \
    --save-dir "$SAVE/cpu"
# last, so that their compiles (flex: a few graphs per dtype) cannot starve the steps above: the
# opt-in kernels' gpu tests, then their time and memory (pass: set FLEX_VERIFIED / list cuDNN as verified)
TAIL=40 step tests-opt-in 420 $PY -m pytest -p no:cacheprovider -m gpu -v -rfEs --tb=short -k "flex or cudnn" \
    "${GPU_TESTS[@]}"
step bench-opt-in 180 $PY benchmarks/bench_kernels.py --seq 8192,32768 --repeats 3 --opt-in

echo "failed steps: ${failed[*]:-none}"
[ ${#failed[@]} = 0 ]
