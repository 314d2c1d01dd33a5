#!/usr/bin/env bash
# Fills .whl/ with the wheels benchmarks/gpu.sh installs on the GPU machine, and writes .whl/COMMIT.
# Run it HERE, in the checkout (the GPU machine reaches no package index), before each device call:
#
#   bash benchmarks/gpu_wheels.sh
#   then the device tool: run(command="STAGES=... bash benchmarks/gpu.sh", carry=[".whl"], timeout_s=600)
#
# review 54h: nothing made .whl, and gpu.sh's one hint, followed as written, fetched this machine's
# cp311 pydantic-core, which the GPU's Python 3.12 refuses: the call lost a machine start.
#
# What it fetches: the packages ampguard needs that the GPU image lacks (the device notes' KINDS.md:
# its python3 has torch, PyYAML, matplotlib, pillow, tqdm, scikit-learn, not pydantic), so pydantic
# and its own needs: pydantic-core, annotated-types, typing-inspection, and typing-extensions (the
# image has one, but pydantic 2.14 needs >= 4.16, which it may not be). Each is pinned to the version
# this venv holds (pydantic pins pydantic-core exactly and raises SystemError on another), built for
# the device's Python (DEVICE_PYTHON, 3.12: 3.12.3 there) on manylinux x86_64, with the device notes'
# pip flags. torch is never carried: the image's CUDA build is the one to measure (and far over the
# 64 MiB a call carries).
#
# .whl/COMMIT: the commit the device measures (git rev-parse HEAD, "-dirty" when tracked files differ
# from it or untracked ones would travel): the device gets a copy of the working tree without .git, so
# gpu.sh reads it there and passes it to the bench's JSON (AMPGUARD_COMMIT). Run this again after a
# commit, or the device's log names the older one.
#
# Idempotent: it downloads into a scratch folder, checks the set (one wheel per name, the pinned
# version, a cp312 manylinux x86_64 pydantic-core), and only then replaces .whl; pip's cache makes a
# rerun quick. A failure leaves .whl as it was, says so in one line, and exits 1 (2: bad input).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEVICE_PYTHON=${DEVICE_PYTHON:-3.12}
NAMES=(pydantic pydantic-core annotated-types typing-inspection typing-extensions)
fail() { echo "gpu_wheels.sh: $1" >&2; exit "${2:-1}"; }

[[ "$DEVICE_PYTHON" =~ ^3\.[0-9]+$ ]] || fail "DEVICE_PYTHON must read like 3.12, not '$DEVICE_PYTHON'" 2
git check-ignore -q .whl/x.whl 2>/dev/null || fail ".whl is not ignored by git: add /.whl/ to .gitignore (the wheels must not be committed)"
pins=$("$PY" - "${NAMES[@]}" <<'PY'
import sys
from importlib import metadata

for name in sys.argv[1:]:
    try:
        print(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        sys.exit(f"gpu_wheels.sh: {name} is not installed in {sys.executable}: set PYTHON to the project's venv")
PY
) || exit 2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# (the device notes' flags; pip matches each manylinux_2_N exactly, so the usual ones are all named)
# shellcheck disable=SC2086
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$DEVICE_PYTHON" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$tmp" $pins > "$tmp.log" 2>&1 \
    || { cat "$tmp.log" >&2; rm -f "$tmp.log"; fail "pip could not download $(echo $pins) for Python $DEVICE_PYTHON (above); .whl left as it was"; }
rm -f "$tmp.log"
# the check: exactly the pinned set, each wheel either pure Python or CPython $DEVICE_PYTHON's on manylinux x86_64
"$PY" - "$tmp" "$DEVICE_PYTHON" $pins <<'PY' || fail ".whl left as it was"
import pathlib, re, sys

folder, py, pins = pathlib.Path(sys.argv[1]), "cp" + sys.argv[2].replace(".", ""), sys.argv[3:]
want = {re.sub(r"[-_.]+", "_", p.split("==")[0]).lower(): p.split("==")[1] for p in pins}
got, bad = {}, []
for wheel in sorted(folder.glob("*.whl")):
    name, version, *_, pyt, abi, plat = wheel.stem.split("-")
    got[name.lower()] = version
    pure = pyt.startswith("py3") and abi == "none" and plat == "any"
    native = pyt == py and abi == py and all(p.startswith("manylinux") and p.endswith("_x86_64") for p in plat.split("."))
    if not (pure or native):
        bad.append(wheel.name)
if got != want or bad:
    sys.exit(f"gpu_wheels.sh: the wheels are not the set for Python {sys.argv[2]} on manylinux x86_64: "
             f"wanted {want}, got {got}{', not for the device: ' + ', '.join(bad) if bad else ''}")
if not any(w.name.startswith(f"pydantic_core-{want['pydantic_core']}-{py}-{py}-manylinux") for w in folder.glob("*.whl")):
    sys.exit(f"gpu_wheels.sh: no {py} manylinux pydantic-core among the wheels")
PY
commit=$(git rev-parse HEAD) || fail "git rev-parse HEAD failed: no commit to write in .whl/COMMIT"
[ -z "$(git status --porcelain)" ] || commit+="-dirty"
rm -rf .whl
mkdir .whl
cp "$tmp"/*.whl .whl/
echo "$commit" > .whl/COMMIT
ls .whl
echo "gpu_wheels.sh: .whl holds $(ls .whl/*.whl | wc -l) wheels for Python $DEVICE_PYTHON ($(du -sh .whl | cut -f1)), commit $commit;" \
     "carry it: run(..., carry=[\".whl\"])"
