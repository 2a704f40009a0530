#!/usr/bin/env bash
# End-to-end decode of the Qwen3-30B-A3B-geometry random Q4_K_M file on the lent GPU machine under
# a 12 GiB budget (docs/benchmarks-gpu.md): both expert modes with the Triton kernels and with the
# torch reference kernels, then the calibrated planner's auto choice against measured modes.
# Usage (on the GPU machine, from the repo root): bash labs/gpu_modes_check.sh OUTDIR
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
[ -d .devwheels ] && python3 -m pip install -q --no-deps .devwheels/*.whl  # gguf, platformdirs
S=$(date +%s)
F=/tmp/qwen3-30b-a3b-random.gguf
[ -f $F ] || python3 -m engine.cli.main synth --geometry qwen3-30b-a3b -o $F --fill-random > /dev/null
for K in fused reference; do
  for MODE in cache cpu; do
    if [ $K = reference ]; then export SHARPI_DEVICE_KERNELS=reference G="--gen 16 --repeat 1"
    else unset SHARPI_DEVICE_KERNELS; G="--gen 32 --repeat 2"; fi
    timeout 120 python3 -m engine.cli.main bench -m $F --prompt 16 $G --device cuda --vram 12GiB \
      --moe $MODE --json > "$OUT/b_${K}_$MODE.json" 2> "$OUT/b_${K}_$MODE.err"
    echo "$K $MODE ($(( $(date +%s) - S )) s):"
    grep -E '"(decode_tok_s|prompt_tok_s|hit_rate|upload_gb_s)"' "$OUT/b_${K}_$MODE.json" | tr -d '\n '; echo
  done
done
unset SHARPI_DEVICE_KERNELS
timeout 90 python3 -m engine.cli.main bench calibrate --device cuda -m $F > "$OUT/calibrate.txt" 2>&1
timeout 250 python3 -m engine.cli.main bench -m $F --prompt 16 --gen 32 --repeat 2 --device cuda \
  --vram 12GiB --compare-modes 2>&1 | tee "$OUT/compare.txt" | tail -8
