#!/usr/bin/env bash
# The first GPU run of the next session on issue #7 (see docs/benchmarks-gpu.md, session 4):
#   1. the CUDA tests of the kernels, the graph step and the PDL chain;
#   2. the three rows PDL made slower, with and without its L2 prefetches (SHARPI_PDL_PREFETCH=0);
#   3. the 32-bit-word Q4_K GEMV prototype against triton_gemv.
# Usage (on the GPU machine, from the repo root, gguf/platformdirs installed): bash packaging/gpu_labs/followups.sh OUT
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
PY="python3 -m pytest -q -p no:cacheprovider -o addopts= -W ignore::DeprecationWarning"
timeout 420 $PY tests/test_triton_gemv.py -k cuda > "$OUT/t_gemv.txt" 2>&1 &
timeout 420 $PY tests/test_triton_moe.py tests/test_triton_q8.py tests/test_pdl.py -k "cuda or pdl" > "$OUT/t_moe.txt" 2>&1 &
timeout 420 $PY tests/test_graph_decode.py -m cuda > "$OUT/t_graph.txt" 2>&1 &
timeout 420 $PY tests/test_runtime.py -k "cuda and (every_placement or quantized or cache)" > "$OUT/t_runtime.txt" 2>&1 &
wait
for f in "$OUT"/t_*.txt; do echo "== $f"; tail -2 "$f"; done
echo "tests: $(( $(date +%s) - S )) s"
for P in 1 0; do
  echo "== SHARPI_PDL_PREFETCH=$P"
  SHARPI_PDL_PREFETCH=$P timeout 150 python3 packaging/gpu_labs/pdl_bench.py Q8_0,Q4_0 moe,o 2>&1 | grep -v Warn
done
timeout 200 python3 packaging/gpu_labs/q4k_words.py 2>&1 | grep -v Warn
echo "total: $(( $(date +%s) - S )) s"
