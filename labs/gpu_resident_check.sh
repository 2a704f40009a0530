#!/usr/bin/env bash
# End-to-end decode of the Qwen3-30B-A3B-geometry random Q4_K_M file with the whole trunk and every
# expert resident on the GPU (--vram 30GiB --moe resident; issue #7): one-token steps as CUDA graph
# replays (engine.runtime.graph_decode), the same without graphs (SHARPI_CUDA_GRAPH=0), and with the
# torch reference kernels (SHARPI_DEVICE_KERNELS=reference, graphs on; then off too if time allows).
# Usage (on the GPU machine, from the repo root): bash labs/gpu_resident_check.sh OUTDIR [RUNS]
#   RUNS: space-separated subset of "graph nograph reference reference_nograph" (default: the first 3)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"
RUNS=${2:-graph nograph reference}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
[ -d .devwheels ] && python3 -m pip install -q --no-deps .devwheels/*.whl  # gguf, platformdirs
S=$(date +%s)
F=/tmp/qwen3-30b-a3b-random.gguf
[ -f $F ] || python3 -m engine.cli.main synth --geometry qwen3-30b-a3b -o $F --fill-random > /dev/null
echo "file ready ($(( $(date +%s) - S )) s)"
for R in $RUNS; do
  case $R in
    graph) ENVS=() ;;
    nograph) ENVS=(SHARPI_CUDA_GRAPH=0) ;;
    reference) ENVS=(SHARPI_DEVICE_KERNELS=reference) ;;
    reference_nograph) ENVS=(SHARPI_DEVICE_KERNELS=reference SHARPI_CUDA_GRAPH=0) ;;
    *) echo "unknown run $R"; continue ;;
  esac
  env "${ENVS[@]}" timeout 200 python3 -m engine.cli.main bench -m $F --prompt 16 --gen 64 --repeat 2 \
    --device cuda --vram 30GiB --moe resident --json > "$OUT/resident_$R.json" 2>> "$OUT/resident.err"
  echo "$R [${ENVS[*]}] rc=$? ($(( $(date +%s) - S )) s):"
  grep -E '"(decode_tok_s|decode_tok_s_all|prompt_tok_s|median_step_ms|hit_rate|placement)"' "$OUT/resident_$R.json" \
    | tr -d '\n' | tr -s ' '; echo
done
