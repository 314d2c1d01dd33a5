#!/usr/bin/env bash
# The GPU checks in one command, for a session lent a device (about 8 minutes on an H100/H200):
# the CUDA tests, then `ampguard bench` resolved to ±1% on the tiny MLP (launch-bound) and on
# GPT-2 small's shape (12 x 768, context 1024), with the sync-free path and the installed peers.
# Results land in $OUT (the device tool's folder) or benchmarks/out.
#
#   bash benchmarks/gpu.sh                      # on the GPU machine
#   DEVICE=cpu QUICK=1 bash benchmarks/gpu.sh   # the same commands on a CPU, a dry run of the script
#
# The GPU image's python3 has torch but not pydantic: carry wheels in .whl (see the device
# notes: `pip download --no-deps --only-binary=:all: ... -d .whl pydantic pydantic-core
# annotated-types typing-inspection`); they are installed into /tmp/site here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
quick=(); [ -n "${QUICK:-}" ] && quick=(--quick)

if [ "$DEVICE" = cuda ]; then
    "$PY" -m pytest -p no:cacheprovider -q tests/e2e/test_cuda.py 2>&1 | tee "$OUT/cuda-tests.log"
fi
# launch-bound: every precision, the sync-free path, the peers; 30 steps a round
"$PY" -m ampguard bench --device "$DEVICE" --models mlp --precisions fp32,bf16,fp16 --fused \
    --resolve 1 --budget 40 "${quick[@]}" --json > "$OUT/bench-mlp.json"
# compute-bound: GPT-2 small's shape in bf16, fewer steps a round (a step is ~0.1 s on an H200)
"$PY" -m ampguard bench --device "$DEVICE" --models "$([ "$DEVICE" = cuda ] && echo gpt2 || echo transformer)" \
    --precisions bf16 --fused --steps 10 --rounds 5 --resolve 1 --budget 120 --peak-tflops 989 \
    "${quick[@]}" --json > "$OUT/bench-gpt2.json"
"$PY" - "$OUT" <<'PY'
import json, sys, pathlib
for path in sorted(pathlib.Path(sys.argv[1]).glob("bench-*.json")):
    data = json.loads(path.read_text())
    print(path.name, data["machine"])
    for r in data["results"]:
        ci = "" if r["ratio_low"] is None else f" [{r['ratio_low']:.3f}, {r['ratio_high']:.3f}]"
        mfu = "" if r["mfu"] is None else f" MFU {r['mfu']:.1%}"
        print(f"  {r['workload']:<24} {r['precision']:<5} {r['contender']:<26} {r['median_ms']:8.3f} ms"
              f"  x{r['ratio_to_bare']:.3f}{ci}  {len(r['rounds'])} rounds ({r['stop']}){mfu}")
PY
