#!/usr/bin/env bash
# Set everything up, then run the tests. Extra arguments go to pytest, e.g.
#   bash scripts/test.sh -m "not slow"     # the quick subset
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1} \
  VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
# --durations: the slowest tests, printed at the end (the suite is kept under 40 minutes).
exec .venv/bin/python -m pytest -ra --durations=40 "$@"
