#!/usr/bin/env bash
# The GPU checks in one command, for a session lent a device (about 9 minutes on an H100/H200),
# each stage under its own time limit so a slow one cannot starve the others:
#   1. the CUDA tests (tests/e2e/test_cuda.py: bit for bit, one sync per step, the sync-free
#      step, `ampguard train`'s fast path with no sync in its step, the fused tail);
#   2. `ampguard train` on GPT-2 small (task.preset gpt2-small, bf16, compile) against the bare
#      compiled loop: tokens/s and MFU (benchmarks/train_vs_bare.py); then on the default model;
#   3. `ampguard bench` resolved to ±1% on the tiny MLP (launch-bound), with the sync-free path,
#      the fused tail and the installed peers; and on the nano MLP, whose CPU figures are the
#      proxy for this one (MLP_MODELS, MLP_PRECISIONS=bf16,fp16 to add fp16);
#   4. `ampguard bench` on GPT-2 small's shape in bf16, the same contenders.
# Results land in $OUT (the device tool's folder) or benchmarks/out; the whole log in gpu.log.
#
#   bash benchmarks/gpu.sh                      # on the GPU machine
#   DEVICE=cpu QUICK=1 bash benchmarks/gpu.sh   # the same commands on a CPU, a dry run of the script
#   STAGES="1 3 4" MLP_MODELS=mlp MLP_BUDGET=60 GPT2_BUDGET=180 bash benchmarks/gpu.sh
#                                               # only the tests and the two benches, with the time
#                                               # the stages skipped (the train goals are met: RESULTS.md);
#                                               # about 7 minutes, under one device command's 600 s
#
# A bench stage's limit follows from its budget (a budget is per case, and each case costs some
# seconds of setup beyond it): MLP_S and GPT2_S override. A bench that reaches its limit still
# prints the whole rounds it measured (it takes timeout's SIGTERM as Ctrl-C), so its JSON is
# complete up to there. Stage 1 runs every CUDA test (no -x) and keeps the whole log.
#
# The GPU image's python3 has torch but not pydantic: carry wheels in .whl (see the device
# notes: `pip download --no-deps --only-binary=:all: ... -d .whl pydantic pydantic-core
# annotated-types typing-inspection typing-extensions`); they are installed into /tmp/site here.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu.log") 2>&1
if ! "$PY" -c "import pydantic" 2>/dev/null && compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ! "$PY" -c "import pydantic, ampguard"; then  # every stage needs them: stop here, not in each stage
    echo "gpu.sh: cannot import pydantic and ampguard (carry .whl with the device call: see above)"
    exit 1
fi
count() { tr ',' '\n' <<< "$1" | grep -c .; }
quick=(); [ -n "${QUICK:-}" ] && quick=(--quick)
stage() { echo "=== $1 ($(date +%T))"; }
STAGES=" ${STAGES:-1 2 2b 3 4} "
want() { [[ "$STAGES" == *" $1 "* ]]; }

[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv
if [ "$DEVICE" = cuda ] && want 1; then
    stage "1. CUDA tests"
    timeout -k 10 140 "$PY" -m pytest -p no:cacheprovider -q -rfE --tb=short -o addopts="" tests/e2e/test_cuda.py \
        > "$OUT/test_cuda.log" 2>&1
    tail -40 "$OUT/test_cuda.log"
fi
if want 2; then
    stage "2. ampguard train vs the bare compiled loop, GPT-2 small"
    timeout "${TRAIN_S:-200}" "$PY" benchmarks/train_vs_bare.py --device "$DEVICE" "${quick[@]}" --out "$OUT"
fi
if want 2b; then
    stage "2b. the same on the embedded default model (small, launch-bound on a GPU), eager"
    timeout 60 "$PY" benchmarks/train_vs_bare.py --device "$DEVICE" --model default --eager --steps 300 --every 60 \
        --skip 60 "${quick[@]}" --out "$OUT"
fi
if want 3; then
    stage "3. bench: tiny MLP (launch-bound)"
    models=${MLP_MODELS:-mlp,nano} precisions=${MLP_PRECISIONS:-bf16} budget=${MLP_BUDGET:-25}
    cases=$(( $(count "$models") * $(count "$precisions") ))
    timeout -k 20 "${MLP_S:-$(( cases * (budget + 30) + 30 ))}" "$PY" -m ampguard bench --device "$DEVICE" \
        --models "$models" --precisions "$precisions" --fused --resolve 1 --budget "$budget" "${quick[@]}" --json \
        > "$OUT/bench-mlp.json"
fi
if want 4; then
    stage "4. bench: GPT-2 small's shape, bf16"
    budget=${GPT2_BUDGET:-70}
    timeout -k 20 "${GPT2_S:-$(( budget + 60 ))}" "$PY" -m ampguard bench --device "$DEVICE" \
        --models "$([ "$DEVICE" = cuda ] && echo gpt2 || echo transformer)" --precisions bf16 --fused --steps 10 \
        --rounds 5 --resolve 1 --budget "$budget" --peak-tflops 989 "${quick[@]}" --json \
        > "$OUT/bench-gpt2.json"
fi
stage "done"
"$PY" - "$OUT" <<'PY'
import json, sys, pathlib
for path in sorted(pathlib.Path(sys.argv[1]).glob("bench-*.json")):
    try:
        data = json.loads(path.read_text())
    except ValueError:
        print(path.name, "incomplete (its stage ran out of time)")
        continue
    print(path.name, data["machine"])
    for r in data["results"]:
        ci = "" if r["ratio_low"] is None else f" [{r['ratio_low']:.3f}, {r['ratio_high']:.3f}]"
        mfu = "" if r["mfu"] is None else f" MFU {r['mfu']:.1%}"
        mfu += "" if r.get("ops") is None else f" {r['ops']} ops/step"
        print(f"  {r['workload']:<24} {r['precision']:<5} {r['contender']:<38} {r['median_ms']:8.3f} ms"
              f"  x{r['ratio_to_bare']:.3f}{ci}  {len(r['rounds'])} rounds ({r['stop']}){mfu}")
PY
