#!/usr/bin/env bash
# Set everything up, then run the test suite (CPU only; CUDA tests skip themselves without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
