#!/usr/bin/env bash
# fp8 against bf16 on the GPT-2-small shape (12 x 768, 12 heads, context 1024, batch 8): tokens/s
# and MFU of torchao float8 training next to bf16, for the bare loop and ampguard's step. Needs a
# GPU with float8 matmuls (compute capability 8.9+: H100, H200, B200, L4...) and torchao
# (pip install 'ampguard[fp8]'). MFU is against PEAK_TFLOPS, the dense bf16 peak by default
# (989 for H100/H200 SXM), so fp8's MFU on the same scale shows its gain over bf16.
#
# Two passes: eager (what `ampguard bench` measures by default: torchao's casts run as separate
# kernels, fp8 may well be slower than bf16 there) and torch.compile'd (how float8 training is
# meant to run; compilation happens during the warm-up steps).
#
#   bash benchmarks/gpu/fp8_vs_bf16.sh            # from the repository root, ~5 minutes on an H100
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
PEAK=${PEAK_TFLOPS:-989}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

echo "== eager"
"$PY" -m ampguard bench --device cuda --models gpt2 --precisions bf16,fp8 --no-peers --peak-tflops "$PEAK" \
    --rounds 5 --steps 10 --warmup 3
echo "== torch.compile"
"$PY" -c "from ampguard.bench import run; run(device='cuda', models='gpt2', precisions='bf16,fp8', peers=False, \
peak_tflops=$PEAK, rounds=5, steps=10, warmup=5, compiled=True)"
