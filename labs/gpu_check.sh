#!/usr/bin/env bash
# The CUDA checks of the hybrid runtime, as run on the lent GPU machine (see docs/benchmarks.md):
#   1. runtime parity tests with device=cuda (every placement vs the CPU engine, small models);
#   2. a random-weight Qwen3-30B-A3B-geometry Q4_K_M file (48 layers, 128 experts x 768, top-8,
#      vocab 151936) under a 12 GiB budget: decode tok/s with experts on the CPU and in the GPU
#      cache, the cache's hit rate and upload GB/s, and what auto would pick.
# Usage (on the GPU machine, from the repo root): bash labs/gpu_check.sh OUTDIR
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
[ -d .devwheels ] && python3 -m pip install -q --no-deps .devwheels/*.whl
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider -o addopts="" -W ignore::DeprecationWarning tests/test_runtime.py -k cuda 2>&1 | tail -5 | tee "$OUT/parity.txt"
F=/tmp/qwen3-30b-a3b-random.gguf
[ -f $F ] || python3 -m engine.cli.main synth --geometry qwen3-30b-a3b -o $F --fill-random
python3 -m engine.cli.main plan -m $F --vram 12GiB -c 4096 --json > "$OUT/plan_auto.json"
for MODE in cpu cache; do
  timeout 240 python3 -m engine.cli.main bench -m $F --prompt 16 --gen 24 --repeat 1 --device cuda --vram 12GiB --moe $MODE --json > "$OUT/bench_$MODE.json" 2> "$OUT/bench_$MODE.err"
  tail -3 "$OUT/bench_$MODE.err"; grep -E '"(placement|decode_tok_s|prompt_tok_s|hit_rate|upload_gb_s)"' "$OUT/bench_$MODE.json"
done
