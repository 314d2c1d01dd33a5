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
# Every process a run or the tests start (torchrun's workers, `python -m ampguard`) imports ampguard:
# its bytecode written once here is read by each (~0.3 s of CPU a process where PYTHONDONTWRITEBYTECODE
# is set, as on the project's machines, and each compiled its 25k lines again). Up-to-date files are skipped.
.venv/bin/python -m compileall -q src/ampguard > /dev/null
