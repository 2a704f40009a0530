#!/usr/bin/env bash
# The Gated DeltaNet hybrids on CUDA (issue #25):
#   1. the CUDA parity tests of the GDN placements: every placement against the CPU engine (tests/test_runtime.py,
#      device=cuda), graph replays carrying the recurrent state (tests/test_graph_decode.py);
#   2. a random-weight Q4_K qwen35moe of Qwen3.6-35B-A3B's layer geometry (hidden 2048, 16 heads of 256, 2 KV heads,
#      GDN 16 key / 32 value heads of 128, conv 4, every 4th layer full attention, rope 64 dims, 8 of E experts of 512,
#      shared expert 512), cut to LAYERS layers and E experts so that it writes in minutes: decode and 512-token prompt
#      tok/s in each expert mode with CUDA graphs and without (SHARPI_CUDA_GRAPH=off).
# Usage (on the GPU machine, from the repo root): bash labs/gdn_check.sh OUTDIR [LAYERS] [E]
set -uo pipefail
OUT=${1:-out}; LAYERS=${2:-8}; E=${3:-64}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider -o addopts="" -W ignore::DeprecationWarning tests/test_runtime.py \
  tests/test_graph_decode.py -k "cuda and (qwen35 or qwen3next or gdn)" 2>&1 | tail -5 | tee "$OUT/parity.txt"
F=/tmp/qwen35moe-l$LAYERS-e$E.gguf
[ -f $F ] || python3 -m engine.cli.main synth --arch qwen35moe -o $F --type Q4_K --override 'ffn_down*=Q6_K' \
  --layers $LAYERS --hidden 2048 --heads 16 --kv-heads 2 --head-dim 256 --experts $E --experts-used 8 \
  --expert-ff 512 --shared-ff 512 --vocab 151936 --ctx 32768 --rope-dim 64 --ssm-conv 4 --ssm-state 128 \
  --ssm-groups 16 --ssm-v-heads 32 --full-attn-interval 4
python3 -m engine.cli.main plan -m $F --vram 12GiB -c 4096 --json > "$OUT/plan_auto.json"
for MODE in cpu cache resident; do
  for GRAPH in graph off; do
    SHARPI_CUDA_GRAPH=$GRAPH timeout 300 python3 -m engine.cli.main bench -m $F --prompt 512 --gen 32 --repeat 1 \
      --device cuda --vram 12GiB --moe $MODE --json > "$OUT/bench_${MODE}_$GRAPH.json" 2> "$OUT/bench_${MODE}_$GRAPH.err"
    echo "== $MODE, SHARPI_CUDA_GRAPH=$GRAPH"; tail -2 "$OUT/bench_${MODE}_$GRAPH.err"
    grep -E '"(placement|decode_tok_s|prompt_tok_s|hit_rate)"' "$OUT/bench_${MODE}_$GRAPH.json"
  done
done
