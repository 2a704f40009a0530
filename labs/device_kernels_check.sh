#!/usr/bin/env bash
# The quantized Triton kernels on the lent GPU machine (see docs/benchmarks-gpu.md):
#   1. CUDA parity tests of the GEMV, fused MoE and tiled kernels, float, q8/dp4a and the lean Q4_K
#      MoE and trunk GEMV (and the expert cache through them), of a captured chain of PDL kernels
#      against the eager calls, and of the read-floor kernel (tests/triton, compiled); the act-mode tables;
#   2. `sharpi bench device-kernels` with the default launch settings (~3 min: a default session's
#      kernels with and without programmatic dependent launch, the f32 and q8 kernels, torch, copy
#      and read floors);
#   3. `--tune`: compile every candidate setting in parallel processes first (Triton's disk cache),
#      then time them one process at a time, and re-run the bench with the winners.
# Usage (on the GPU machine, from the repo root): bash labs/device_kernels_check.sh OUTDIR
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
[ -d .devwheels ] && python3 -m pip install -q --no-deps .devwheels/*.whl
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
S=$(date +%s)
timeout 420 python3 -m pytest -q -p no:cacheprovider -o addopts="" -W ignore::DeprecationWarning tests/triton \
  --durations=0 2>&1 | tail -25 | tee "$OUT/tests.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" -W ignore::DeprecationWarning \
  tests/test_triton_q8.py tests/test_runtime.py tests/test_pdl.py tests/test_read_floor.py \
  -k "(cuda and (triton or moe or quantized or q8)) or pdl or moe_act or trunk_act or read or tuner" \
  --durations=0 2>&1 | tail -25 | tee -a "$OUT/tests.txt"
echo "tests: $(( $(date +%s) - S )) s"
timeout 420 python3 -m engine.cli.main bench device-kernels 2>&1 | tee "$OUT/bench_default.txt"
echo "bench: $(( $(date +%s) - S )) s"
if [ "${TUNE:-1}" = 1 ]; then
  for t in Q4_0 Q8_0 Q4_K Q5_K Q6_K; do
    timeout 170 python3 -m engine.cli.main bench device-kernels --tune --types $t --workloads moe > /tmp/warm_$t.txt 2>&1 &
  done
  wait; tail -n 3 /tmp/warm_*.txt > "$OUT/warm.txt"
  echo "warm: $(( $(date +%s) - S )) s"
  timeout 200 python3 -m engine.cli.main bench device-kernels --tune 2>&1 | tee "$OUT/tune.txt"
  echo "tune: $(( $(date +%s) - S )) s"
fi
