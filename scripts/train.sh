#!/usr/bin/env bash
# Set everything up, then run the main job: guarded training on the embedded default workload.
# The set-up runs in the repository; the run in the folder you called this from, so a relative
# CONFIG, --resume RUN or log.dir names what it names for `ampguard train` itself.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
(cd "$root" && bash scripts/setup.sh)
exec "$root/.venv/bin/ampguard" train "$@"
