#!/usr/bin/env bash
# Set everything up, then run the main job: guarded training on the embedded default workload.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/ampguard train "$@"
