#!/usr/bin/env bash
# The GPU checks in one command, for a session lent a device. First, HERE (not on the device):
#   bash benchmarks/gpu_wheels.sh     # .whl: the wheels the GPU's Python lacks, and .whl/COMMIT
# then the device tool's call, carrying them (600 s: the stages' worst case fits, below):
#   run(command='STAGES="1 3 4" MLP_MODELS=mlp MLP_BUDGET=60 GPT2_BUDGET=180 bash benchmarks/gpu.sh',
#       carry=[".whl"], timeout_s=600)
# The checks (about 5 minutes on an H200; each
# stage under its own time limit, so a slow one cannot starve the others, and the limits, kill
# grace and setup included, add up to at most 575 s: under one device command's 600 s):
#   1. the CUDA tests (tests/e2e/test_cuda.py: bit for bit, one sync per step, the sync-free
#      step, `ampguard train`'s fast path with no sync in its step, the fused tail);
#   2. `ampguard train` on GPT-2 small (task.preset gpt2-small, bf16, compile) against the bare
#      compiled loop: tokens/s and MFU (benchmarks/train_vs_bare.py: 6 paired blocks of 80 steps a
#      run, the bare loop and `ampguard train` alternating; about 105 s on an H200, 30 of them
#      compiling); 2b. then on the default model (6 blocks of 150 steps);
#   3. `ampguard bench` resolved to ±1% on the tiny MLP (launch-bound), with the sync-free path,
#      the fused tail and the installed peers; and on the nano MLP, whose CPU figures are the
#      proxy for this one (MLP_MODELS, MLP_PRECISIONS=bf16,fp16 to add fp16);
#   4. `ampguard bench` on GPT-2 small's shape in bf16, the same contenders, at batch 32
#      (GPT2_BATCH; the bench's own 8 is launch-bound on an H200, its rounds ±3% apart, so ±1%
#      was out of reach: 2026-12-04); MFU against the GPU's dense bf16 peak
#      (ampguard.events.known_peak_tflops; PEAK_TFLOPS overrides).
# Results land in $OUT (the device tool's folder) or benchmarks/out; the whole log in gpu.log.
#
#   bash benchmarks/gpu.sh                      # on the GPU machine
#   DEVICE=cpu QUICK=1 bash benchmarks/gpu.sh   # the same commands on a CPU, a dry run of the script
#   PLAN_ONLY=1 bash benchmarks/gpu.sh          # only print the stage limits and their worst case
#   STAGES="1 3 4" MLP_MODELS=mlp MLP_BUDGET=60 GPT2_BUDGET=180 bash benchmarks/gpu.sh
#                                               # only the tests and the two benches, with the time
#                                               # the stages skipped (the train goals are met: RESULTS.md);
#                                               # at most 530 s, kill grace and setup included
#
# Default limits (seconds, + the grace after timeout's SIGTERM before its SIGKILL): stage 1 90
# (+10), stage 2 TRAIN_S=130 (+20), stage 2b TRAIN2B_S=40 (+20), stage 3 (mlp,nano at a budget
# of 20) 100 (+20), stage 4 (a budget of 25) 105 (+20), and 20 for setup and the summary.
# A bench stage's limit follows from its budget (a budget is per case): MLP_S and GPT2_S override.
# Beyond it, an MLP stage takes 40 s to start (imports, the peers) and 10 s a case (its last
# round, the next case's setup); GPT-2 80 s (the model's build, the fused tail's compile, one
# 4-5 s round past the budget). Review 54h: the allowances were 25 a case and 60, and left the
# header's call 9 s over stage 3's 86 s and about 12 s over stage 4's 228 s (H200, 2026-12-04:
# 26 s and 39-44 s beyond the budget), on the H200; a plain call gets an H100, whose slower
# memory stretches the setup. Now: stage 3 1 x (60 + 10) + 40 = 110, stage 4 180 + 80 = 260, so
# the header's call is 20 + (90 + 10) + (110 + 20) + (260 + 20) = 530 s at worst, 70 s under 600;
# the defaults stay 575 s (stage 3 2 x (20 + 10) + 40 = 100; stage 4's default budget went from
# 45 to 25 to keep 105). Stage 4's default budget cannot resolve ±1% (an H200 gave ±5-7% in 100 s):
# the header's call gives it 180 s. Each stage's exit code is printed and summed up at the end
# (0; a time limit: 124/137/143; bad input: 2; else a failure), and the script exits 1 when any
# stage did not exit 0. A bench writes its JSON beside the old one and replaces it only with
# whole JSON (json.load reads it: a refused rerun, or one a signal cut mid-write, leaves the last
# good JSON in place). A bench
# that reaches its limit still prints the whole rounds it measured (it takes timeout's SIGTERM
# as Ctrl-C), so its JSON is complete up to there; train_vs_bare.py stops with a non-zero exit
# when a run is cut short, rather than report it (its JSON is written whole or not at all).
# Stage 1 runs every CUDA test (no -x) and keeps the whole log.
#
# The GPU image's python3 has torch but not pydantic: benchmarks/gpu_wheels.sh, run here first,
# fetches the wheels (for the device's Python 3.12, pinned to this venv's versions) into .whl, which
# the call carries; they are installed into /tmp/site there. The log's "commit:" line names the
# code measured (git's, else .whl/COMMIT's: the device's copy has no .git), and the bench's JSON
# takes it (AMPGUARD_COMMIT; review 54h).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-benchmarks/out}
STAGES=" ${STAGES:-1 2 2b 3 4} "
want() { [[ "$STAGES" == *" $1 "* ]]; }
count() { tr ',' '\n' <<< "$1" | grep -c .; }

# the stage limits, and their worst case with each kill grace (and 20 s of setup and summary)
MLP_MODELS=${MLP_MODELS:-mlp,nano} MLP_PRECISIONS=${MLP_PRECISIONS:-bf16} MLP_BUDGET=${MLP_BUDGET:-20}
GPT2_BUDGET=${GPT2_BUDGET:-25} GPT2_BATCH=${GPT2_BATCH:-32} TESTS_S=${TESTS_S:-90} TRAIN_S=${TRAIN_S:-130} TRAIN2B_S=${TRAIN2B_S:-40}
MLP_S=${MLP_S:-$(( $(count "$MLP_MODELS") * $(count "$MLP_PRECISIONS") * (MLP_BUDGET + 10) + 40 ))}
GPT2_S=${GPT2_S:-$(( GPT2_BUDGET + 80 ))}  # (the allowances' arithmetic: the header)
plan="" worst=20
if [ "$DEVICE" = cuda ] && want 1; then plan+=" 1: ${TESTS_S}+10"; worst=$(( worst + TESTS_S + 10 )); fi
if want 2; then plan+=" 2: ${TRAIN_S}+20"; worst=$(( worst + TRAIN_S + 20 )); fi
if want 2b; then plan+=" 2b: ${TRAIN2B_S}+20"; worst=$(( worst + TRAIN2B_S + 20 )); fi
if want 3; then plan+=" 3: ${MLP_S}+20"; worst=$(( worst + MLP_S + 20 )); fi
if want 4; then plan+=" 4: ${GPT2_S}+20"; worst=$(( worst + GPT2_S + 20 )); fi
plan="stage limits (s, + kill grace):${plan:- none}; worst case ${worst} s with setup"
if [ -n "${PLAN_ONLY:-}" ]; then
    echo "$plan"
    exit 0
fi

mkdir -p "$OUT"
exec 3>&1 4>&2
exec > >(tee "$OUT/gpu.log") 2>&1
tee_pid=$!
finish() {  # finish CODE: the log's tee gets its end of file; wait for its last lines, then exit
    exec 1>&3 2>&4 3>&- 4>&-
    wait "$tee_pid" 2>/dev/null || true
    exit "$1"
}
echo "$plan"
[ "$worst" -gt 600 ] && echo "gpu.sh: warning: the stages may take ${worst} s, more than one device command's 600 s"
# the commit measured: git's where this is a checkout, else the one gpu_wheels.sh wrote (review 54h)
if [ "$(git rev-parse --show-toplevel 2>/dev/null)" = "$(pwd -P)" ] && commit=$(git rev-parse HEAD 2>/dev/null); then
    [ -z "$(git status --porcelain 2>/dev/null)" ] || commit+="-dirty"
else
    commit=$(head -1 .whl/COMMIT 2>/dev/null) || commit=""
fi
if [ -n "$commit" ]; then
    export AMPGUARD_COMMIT=$commit
    echo "commit: $commit"
else
    echo "commit: unknown (no git checkout here, and no .whl/COMMIT: benchmarks/gpu_wheels.sh writes it)"
fi
if ! "$PY" -c "import pydantic" 2>/dev/null && compgen -G ".whl/*.whl" > /dev/null; then
    # review 54h: wheels for another Python (the cp311 ones the old hint fetched) failed here, and the
    # line after pip's error said to carry .whl, which had been carried
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
        echo "gpu.sh: the wheels in .whl do not install under $("$PY" -V 2>&1) (made for another Python?):" \
             "run \`bash benchmarks/gpu_wheels.sh\` in the checkout and carry .whl again"
        finish 1
    fi
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# every stage needs pydantic and ampguard: stop here, not in each stage; and the GPU's bf16 peak
if ! peak=$("$PY" - "$DEVICE" <<'PY'
import sys

import pydantic  # noqa: F401
import torch

from ampguard.events import known_peak_tflops

cuda = sys.argv[1] == "cuda" and torch.cuda.is_available()
print((known_peak_tflops(torch.cuda.get_device_name()) or "") if cuda else "")
PY
); then
    echo "gpu.sh: cannot import pydantic and ampguard: run \`bash benchmarks/gpu_wheels.sh\` in the checkout, and carry .whl (carry=[\".whl\"])"
    finish 1
fi
PEAK_TFLOPS=${PEAK_TFLOPS:-$peak}
peak_arg=(); [ -n "$PEAK_TFLOPS" ] && peak_arg=(--peak-tflops "$PEAK_TFLOPS")
quick=(); [ -n "${QUICK:-}" ] && quick=(--quick)
stage() { echo "=== $1 ($(date +%T))"; }
codes=()  # "stage=exit code" of each stage run
ended() {  # ended STAGE RC: say how the stage ended, and keep it for the summary
    local how=ok
    case "$2" in 0) ;; 124|137|143) how="cut by its time limit" ;; 2) how="refused (bad input)" ;; *) how=failed ;; esac
    echo "stage $1 ended with exit $2 ($how)"
    codes+=("$1=$2")
}
bench_json() {  # bench_json STAGE FILE: a bench's JSON replaces FILE only when it is whole JSON
    if "$PY" -c 'import json, sys; json.load(open(sys.argv[1]))' "$2.tmp" 2>/dev/null; then
        mv -f "$2.tmp" "$2"
    else
        rm -f "$2.tmp"; echo "stage $1 wrote no JSON, or JSON cut short; $2 left as it was"
    fi
}

[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv
if [ "$DEVICE" = cuda ] && want 1; then
    stage "1. CUDA tests"
    timeout -k 10 "$TESTS_S" "$PY" -m pytest -p no:cacheprovider -q -rfE --tb=short -o addopts="" \
        tests/e2e/test_cuda.py > "$OUT/test_cuda.log" 2>&1
    rc=$?
    tail -40 "$OUT/test_cuda.log"
    ended 1 "$rc"
fi
if want 2; then
    stage "2. ampguard train vs the bare compiled loop, GPT-2 small"
    timeout -k 20 "$TRAIN_S" "$PY" benchmarks/train_vs_bare.py --device "$DEVICE" "${quick[@]}" --out "$OUT"
    ended 2 $?
fi
if want 2b; then
    stage "2b. the same on the embedded default model (small, launch-bound on a GPU), eager"
    # (--quick runs one small model whatever --model says: its JSON, train-vs-bare-quick.json, beside stage 2's)
    out2b="$OUT"; [ -n "${QUICK:-}" ] && out2b="$OUT/2b"
    timeout -k 20 "$TRAIN2B_S" "$PY" benchmarks/train_vs_bare.py --device "$DEVICE" --model default --eager \
        --steps 150 --every 30 --skip 60 "${quick[@]}" --out "$out2b"
    ended 2b $?
fi
if want 3; then
    stage "3. bench: tiny MLP (launch-bound)"
    timeout -k 20 "$MLP_S" "$PY" -m ampguard bench --device "$DEVICE" --models "$MLP_MODELS" \
        --precisions "$MLP_PRECISIONS" --fused --resolve 1 --budget "$MLP_BUDGET" "${quick[@]}" --json \
        > "$OUT/bench-mlp.json.tmp"
    ended 3 $?
    bench_json 3 "$OUT/bench-mlp.json"
fi
if want 4; then
    stage "4. bench: GPT-2 small's shape, bf16"
    timeout -k 20 "$GPT2_S" "$PY" -m ampguard bench --device "$DEVICE" \
        --models "$([ "$DEVICE" = cuda ] && echo gpt2 || echo transformer)" --batch "$GPT2_BATCH" --precisions bf16 --fused --steps 10 \
        --rounds 5 --resolve 1 --budget "$GPT2_BUDGET" "${peak_arg[@]}" "${quick[@]}" --json \
        > "$OUT/bench-gpt2.json.tmp"
    ended 4 $?
    bench_json 4 "$OUT/bench-gpt2.json"
fi
stage "done"
"$PY" - "$OUT" <<'PY'
import json, sys, pathlib
for path in sorted(pathlib.Path(sys.argv[1]).glob("bench-*.json")):
    try:
        data = json.loads(path.read_text())
    except ValueError:
        print(path.name, "is not whole JSON (its stage's exit code is above)")
        continue
    load = data.get("load_avg")  # (1, 5, 15 minutes before the bench; above the CPUs: timings not to be trusted)
    commit = (data.get("versions") or {}).get("ampguard_commit")  # (the code measured: review 54h)
    print(path.name, data["machine"] + (", load " + " ".join(f"{x:.2f}" for x in load) if load else "")
          + (" (busier than its CPUs: timings not to be trusted)" if data.get("load_above_cpus") else "")
          + (f", commit {commit}" if commit else ""))
    print("  run:", " ".join(f"{k}={v}" for k, v in (data.get("run") or {}).items()))
    for r in data["results"]:
        ratio = "" if r["ratio_to_bare"] is None else f"x{r['ratio_to_bare']:.3f}"  # (null: no bare loop ran)
        ci = "" if r["ratio_low"] is None else f" [{r['ratio_low']:.3f}, {r['ratio_high']:.3f}]"
        mfu = "" if r["mfu"] is None else f" MFU {r['mfu']:.1%}"
        mfu += "" if r.get("ops") is None else f" {r['ops']} ops/step"
        print(f"  {r['workload']:<24} {r['precision']:<5} {r['contender']:<38} {r['median_ms']:8.3f} ms"
              f"  {ratio:>6}{ci}  {len(r['rounds'])} rounds ({r['stop']}{': ' + r['stop_detail'] if r.get('stop_detail') else ''}){mfu}")
    for v in data.get("versus") or []:  # ampguard over each peer, paired by round
        ci = "" if v["low"] is None else f" [{v['low']:.3f}, {v['high']:.3f}]"
        print(f"  {v['workload']:<24} {v['precision']:<5} {v['contender']} / {v['peer']}: x{v['ratio']:.3f}{ci} paired")
PY
echo "stages: ${codes[*]:-none ran}"
failed=0
for code in "${codes[@]}"; do [ "${code#*=}" = 0 ] || failed=1; done
finish "$failed"
