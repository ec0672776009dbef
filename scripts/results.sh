#!/usr/bin/env bash
# Regenerate docs/RESULTS.md on a fresh machine: set up both venvs (ours and kvpress's), run
# the accuracy suite with kvpress side by side (about 45 minutes on 2 cores), render the page.
# Extra arguments go to `python -m benchmarks results`, e.g. --render-only.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_kvpress.sh
export HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
exec .venv/bin/python -m benchmarks results "$@"
