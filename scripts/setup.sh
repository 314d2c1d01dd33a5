#!/usr/bin/env bash
# Creates ./.venv and installs ampguard with its pinned PyTorch. Idempotent: a second run that
# finds the same pyproject.toml and this script unchanged installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_PIN="torch==2.13.0"   # the CPU build on the local index; the package itself asks torch>=2.4
PY="${PYTHON:-python3}"

[ -x .venv/bin/python ] || "$PY" -m venv .venv

stamp=.venv/.ampguard-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "$TORCH_PIN"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]" "$TORCH_PIN"
    echo "$want" > "$stamp"
fi
