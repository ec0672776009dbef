#!/usr/bin/env bash
# Every check the lent GPU machine can run, in one call (it has a GPU, PyTorch and Triton; no
# vLLM, nothing downloadable). From the repository root:
#
#   OUT=DIR bash scripts/gpu_check.sh            # DIR defaults to results/gpu
#   OUT=DIR bash scripts/gpu_check.sh tests      # the stages named: env build tests fdc-layer steps plan kernels
#   DEADLINE=300 bash scripts/gpu_check.sh       # the whole call in 300 s (default 540)
#
# Stages, in this order (the most needed first), each under its own time limit cut to what is
# left of DEADLINE, each going on when an earlier one failed (one broken stage loses nothing
# else), each writing into $OUT with the GPU's tag (h100, h200, ...):
#   env        env_TAG.txt: nvidia-smi's name/driver/memory, torch, Triton, CUDA
#   build      build_TAG.txt: `setup.py build_ext --inplace` (the C++ ops the planner uses, the
#              CUDA slot ops `bench gpu-kernels` times from csrc/cuda when nvcc is found
#              (KVPRUNE_CUDA_SLOT_OPS=1), and FDC's CUTLASS projections from csrc/cutlass
#              when CUTLASS's headers are: carry `.cutlass-include`, made here by
#              `python -m tools.cutlass_check --fetch --headers-for .cutlass-include`)
#   tests      pytest_TAG.txt: every Triton kernel and the impl's policy steps on CUDA tensors
#              against their torch references (pytest -m triton --noconftest)
#   fdc-layer  fdc_layer_TAG.{json,txt,png}: bench gpu-kernels --cases fdc-layer (where one FDC
#              layer's step goes, and the CUTLASS grouped projections against torch's einsums)
#   steps      steps_TAG.{json,txt,png}: bench gpu-steps (the wrapper's KV work per decode step)
#   plan       plan_steps_TAG.{json,txt,png}: bench plan-steps (the host's planning alone, on that host)
#   kernels    kernels_TAG.{json,txt,png}: bench gpu-kernels (each kernel against plain torch)
# A stage that would have under 30 s is skipped and said so. The last line says which stages
# passed, failed or were skipped. A lent machine has about 15 minutes in all, its start
# included, and one call may run 10: `DEADLINE=300 bash scripts/gpu_check.sh` leaves room for
# a second call on what was skipped (the tests took 133 s on an H100 on 2026-11-27).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env build tests fdc-layer steps plan kernels)
DEADLINE=${DEADLINE:-540}
# The CUTLASS headers carried from the CPU machine (the GPU machine has no package index).
[ -z "${CUTLASS_INCLUDE_DIR:-}" ] && [ -d .cutlass-include/cutlass ] && export CUTLASS_INCLUDE_DIR=$PWD/.cutlass-include

TAG=$($PYTHON -c "import torch; from benchmarks.gpu_kernels import gpu_slug; \
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
  local left=$((DEADLINE - SECONDS - 5))
  if [ $left -lt 30 ]; then
    summary+=("$name=skipped(no time)")
    echo "== $name: skipped, $((DEADLINE - SECONDS)) s of DEADLINE=$DEADLINE left"
    return
  fi
  [ $left -lt "$seconds" ] && seconds=$left
  local started=$SECONDS
  timeout "$seconds" "$@" > "$log" 2>&1
  local rc=$?
  summary+=("$name=$([ $rc -eq 0 ] && echo ok || echo "failed($rc)")/$((SECONDS - started))s")
  echo "== $name: rc $rc in $((SECONDS - started)) s of at most $seconds ($log)"
  tail -n 3 "$log"
}

for stage in "${stages[@]}"; do
  case $stage in
    env)
      run_stage env 60 "$OUT/env_$TAG.txt" bash -c describe_machine ;;
    build)
      run_stage build 300 "$OUT/build_$TAG.txt" env MAX_JOBS=${MAX_JOBS:-16} KVPRUNE_CUDA_SLOT_OPS=1 \
        $PYTHON setup.py build_ext --inplace ;;
    tests)
      run_stage tests 400 "$OUT/pytest_$TAG.txt" $PYTHON -m pytest -q -p no:cacheprovider -m triton --noconftest \
        tests/test_triton_attention.py tests/test_triton_fdc_vote.py tests/test_triton_fdc_write.py \
        tests/test_triton_fdc_projections.py \
        tests/test_triton_slot_ops.py tests/test_triton_policy_steps.py tests/test_bench_gpu_kernels.py \
        tests/test_fdc_projections.py ;;
    fdc-layer)
      run_stage fdc-layer 120 "$OUT/fdc_layer_$TAG.txt" $PYTHON -m benchmarks.gpu_kernels \
        --cases fdc-layer --out "$OUT/fdc_layer_$TAG" ;;
    kernels)
      run_stage kernels 300 "$OUT/kernels_$TAG.txt" $PYTHON -m benchmarks.gpu_kernels --out "$OUT/kernels_$TAG" ;;
    steps)
      run_stage steps 300 "$OUT/steps_$TAG.txt" $PYTHON -m benchmarks.gpu_steps --out "$OUT/steps_$TAG" ;;
    plan)
      run_stage plan 120 "$OUT/plan_steps_$TAG.txt" $PYTHON -m benchmarks.plan_steps \
        --out "$OUT/plan_steps_$TAG.json" ;;
    *)
      echo "unknown stage '$stage' (env build tests fdc-layer steps plan kernels)" >&2
      exit 2 ;;
  esac
done
echo "gpu_check on $TAG: ${summary[*]}"
