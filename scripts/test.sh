#!/usr/bin/env bash
# Set everything up, then run the test suite (CPU only; CUDA tests skip themselves without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two worker processes (pytest-xdist), one per core of the machine the suite is sized for, each
# module whole in one of them (--dist loadfile: a module's fixtures, its early job, made once);
# AMPGUARD_TEST_WORKERS=0 runs it in this one process. Arguments after these win (-n 4, -p no:xdist).
exec .venv/bin/python -m pytest -n "${AMPGUARD_TEST_WORKERS:-2}" --dist loadfile "$@"
