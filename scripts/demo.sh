#!/usr/bin/env bash
# The main job on a fresh machine: set everything up, then batch-generate with the real
# model under a KV policy and print the KV memory used against `none`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
