#!/usr/bin/env bash
# Every check the lent GPU machine can run, in one call (it has a GPU, PyTorch and Triton; no
# vLLM, nothing downloadable). From the repository root:
#
#   OUT=DIR bash scripts/gpu_check.sh            # DIR defaults to results/gpu
#   OUT=DIR bash scripts/gpu_check.sh tests      # the stages named: env build tests kernels steps plan
#
# Stages, each under its own time limit, each going on when an earlier one failed (one broken
# stage loses nothing else), each writing into $OUT with the GPU's tag (h100, h200, ...):
#   env      env_TAG.txt: nvidia-smi's name/driver/memory, torch, Triton, CUDA
#   build    build_TAG.txt: `setup.py build_ext --inplace` (the C++ ops the planner uses, and the
#            CUDA slot ops from csrc/cuda when nvcc is found)
#   tests    pytest_TAG.txt: every Triton kernel and the impl's policy steps on CUDA tensors
#            against their torch references (pytest -m triton --noconftest)
#   kernels  kernels_TAG.{json,txt,png}: bench gpu-kernels (each kernel against plain torch)
#   steps    steps_TAG.{json,txt,png}: bench gpu-steps (the wrapper's KV work per decode step)
#   plan     plan_steps_TAG.{json,txt,png}: bench plan-steps (the host's planning alone, on that host)
# The last line says which stages passed. Not yet run on a GPU: its limits add up to 25 minutes,
# more than one device call may take (10), so name the stages in two calls where that matters:
# `env build tests`, then `kernels steps plan` (the tests took 133 s on an H100 before).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env build tests kernels steps plan)

TAG=$($PYTHON -c "import torch; from vllm_kvprune.bench.gpu_kernels import gpu_slug; \
print(gpu_slug('cuda' if torch.cuda.is_available() else 'cpu'))" 2>/dev/null || echo unknown)
summary=()

describe_machine() {  # fails where there is no NVIDIA GPU, after saying what there is
  $PYTHON -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
}
export -f describe_machine
export PYTHON

run_stage() {  # name, seconds, log file, command...
  local name=$1 seconds=$2 log=$3
  shift 3
  local started=$SECONDS
  timeout "$seconds" "$@" > "$log" 2>&1
  local rc=$?
  summary+=("$name=$([ $rc -eq 0 ] && echo ok || echo "failed($rc)")/$((SECONDS - started))s")
  echo "== $name: rc $rc in $((SECONDS - started)) s ($log)"
  tail -n 3 "$log"
}

for stage in "${stages[@]}"; do
  case $stage in
    env)
      run_stage env 60 "$OUT/env_$TAG.txt" bash -c describe_machine ;;
    build)
      run_stage build 300 "$OUT/build_$TAG.txt" env MAX_JOBS=${MAX_JOBS:-16} $PYTHON setup.py build_ext --inplace ;;
    tests)
      run_stage tests 400 "$OUT/pytest_$TAG.txt" $PYTHON -m pytest -q -p no:cacheprovider -m triton --noconftest \
        tests/test_triton_attention.py tests/test_triton_fdc_vote.py tests/test_triton_fdc_write.py \
        tests/test_triton_slot_ops.py tests/test_triton_policy_steps.py tests/test_bench_gpu_kernels.py ;;
    kernels)
      run_stage kernels 300 "$OUT/kernels_$TAG.txt" $PYTHON -m vllm_kvprune.bench.gpu_kernels --out "$OUT/kernels_$TAG" ;;
    steps)
      run_stage steps 300 "$OUT/steps_$TAG.txt" $PYTHON -m vllm_kvprune.bench.gpu_steps --out "$OUT/steps_$TAG" ;;
    plan)
      run_stage plan 120 "$OUT/plan_steps_$TAG.txt" $PYTHON -m vllm_kvprune.bench.plan_steps \
        --out "$OUT/plan_steps_$TAG.json" ;;
    *)
      echo "unknown stage '$stage' (env build tests kernels steps plan)" >&2
      exit 2 ;;
  esac
done
echo "gpu_check on $TAG: ${summary[*]}"
