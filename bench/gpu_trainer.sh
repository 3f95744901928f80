#!/usr/bin/env bash
# Tokens/s and MFU of the trainer on one GPU: tiny and small, bf16 + torch.compile.
# The trainer prints "tok/s" and "mfu" (from the device's peak in trainer/parallel.py PEAK_FLOPS;
# an unlisted GPU shows "mfu n/a" unless CLUSTERCTL_PEAK_TFLOPS=<dense bf16 TFLOP/s> is set);
# this keeps the last progress line of each run. Usage: bash bench/gpu_trainer.sh [steps]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
STEPS=${1:-60}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA/ROCm GPU visible")'
echo "device: $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')"
for preset in tiny small; do
  case $preset in tiny) BS=32 ;; small) BS=16 ;; esac
  "$PY" -m trainer --preset "$preset" --pad-vocab --tokenizer gpt2 --precision bf16 --compile \
    --batch-size "$BS" --max-steps "$STEPS" --warmup-steps 10 --log-every 10 --eval-every 0 \
    --sample-tokens 0 --resume none --ckpt-every 0 --output-dir "$OUT/$preset" >"$OUT/$preset.log" 2>&1 \
    || { tail -20 "$OUT/$preset.log"; exit 1; }
  echo "$preset (bf16, compile, batch $BS): $(grep '^step .* | tok/s' "$OUT/$preset.log" | tail -1)"
done
