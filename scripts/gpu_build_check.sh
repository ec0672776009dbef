#!/usr/bin/env bash
# Build the GPU extensions (csrc/cutlass's grouped projections, which serving uses, and csrc/cuda's
# slot ops, a benchmark's: KVPRUNE_CUDA_SLOT_OPS=1 asks setup.py for them) against a CUDA
# build of torch on a machine without a GPU, then load them and check their ops registered.
# Compiling and linking need no GPU; running the ops does (scripts/gpu_check.sh, on a GPU machine).
#
#   bash scripts/gpu_build_check.sh        # log in results/gpu/gpu_build_check.txt
#
# Needs nvcc (CUDA_HOME, default /usr/local/cuda) of the CUDA major version the torch below is
# built for, and pip access to that torch: TORCH_SPEC (default torch==2.14.1, a CUDA 13.0 build
# this project's machines hold on disk) goes into VENV (default ~/.cache/vllm-kvprune/cuda-torch,
# about 5.5 GB). CUTLASS's headers: CUTLASS_INCLUDE_DIR, else fetched by
# `python -m tools.cutlass_check --fetch`. The build runs in a copy of the tree,
# so no .so lands in this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VENV:-$HOME/.cache/vllm-kvprune/cuda-torch}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
LOG=${LOG:-results/gpu/gpu_build_check.txt}
mkdir -p "$(dirname "$LOG")"

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "$TORCH_SPEC" numpy setuptools wheel
fi
if [ -z "${CUTLASS_INCLUDE_DIR:-}" ]; then
  .venv/bin/python -m tools.cutlass_check --fetch --headers-for "$VENV/cutlass-include" > /dev/null
  export CUTLASS_INCLUDE_DIR=$VENV/cutlass-include
fi
# The CUDA headers torch's own headers include (cuBLAS, cuSPARSE) come with torch's pip wheels.
NVIDIA_INCLUDE=$("$VENV/bin/python" -c 'import nvidia, pathlib; print(next(pathlib.Path(p) for p in nvidia.__path__) / "cu13" / "include")')
export CPATH=$NVIDIA_INCLUDE${CPATH:+:$CPATH}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-2}

BUILD=$(mktemp -d)
trap 'rm -rf "$BUILD"' EXIT
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$BUILD"
cp -r csrc vllm_kvprune benchmarks setup.py pyproject.toml "$BUILD"/  # uncommitted work too
{
  echo "== $(date -u +%FT%TZ) head $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- csrc setup.py || echo ' with uncommitted csrc/setup.py changes'); torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
  echo "== nvcc: $("$CUDA_HOME/bin/nvcc" --version | tail -1); TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST; CUTLASS: $CUTLASS_INCLUDE_DIR"
  (cd "$BUILD" && KVPRUNE_CUDA_SLOT_OPS=1 "$VENV/bin/python" setup.py build_ext --inplace 2>&1 \
    | grep -E "vllm-kvprune setup|error|warning: .*kvprune" || true)
  cd "$BUILD" && "$VENV/bin/python" - <<'EOF'
import importlib

import torch

# First as they are loaded (kernels/op_library.py: the built extension, before any JIT).
from benchmarks.cuda_ops import LIBRARY as slot_ops
from vllm_kvprune.kernels.grouped_gemm import LIBRARY as cutlass_ops

for library in (slot_ops, cutlass_ops):
    assert library.load(), library.error
    print(f"{library.what}: {library.module} loaded through OpLibrary")
for module, namespace, ops in (("vllm_kvprune._cuda_C", "kvprune_cuda", ("write_slots", "read_slots", "copy_slots")),
                               ("vllm_kvprune._cutlass_C", "kvprune_cutlass", ("grouped_gemm",))):
    importlib.import_module(module)  # fails on an undefined symbol
    for op in ops:
        schema = getattr(getattr(torch.ops, namespace), op).default._schema
        print(f"loaded {module}: {schema}")
print("gpu_build_check: both GPU extensions built, loaded and registered their ops")
EOF
} 2>&1 | tee "$LOG"
