#!/usr/bin/env bash
# The whole test suite, as CI runs it (the README's test command). Four steps, each must pass:
#   1. lint: ruff check and ruff format --check (ruff is pinned in the test extra);
#   2. the tests (pytest's testpaths; the Triton kernel tests skip here without CUDA), with the 60 slowest listed;
#   3. the Triton kernels in Triton's CPU interpreter (TRITON_INTERPRET is read when Triton is
#      imported, so they need an interpreter of their own);
#   4. the tests whose code path depends on the processor (marker cpu_paths) again with its
#      features masked — no VNNI, no bf16 prompt path, oneDNN capped below AMX — so both paths
#      run on whichever processor this is (skipped on one with none of those features: pytest ran those paths).
# Everyday loop instead: QT_QPA_PLATFORM=offscreen python -m pytest -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
export QT_QPA_PLATFORM=${QT_QPA_PLATFORM:-offscreen}

echo "== lint"
ruff check .
ruff format --check .

echo "== tests"
python -m pytest -q --durations=60

echo "== Triton kernels in the interpreter"
rc=0
TRITON_INTERPRET=1 python -m pytest -q --durations=15 tests/triton || rc=$?
# 5: nothing ran — no Triton installed here (the skip reason above says so); anything else fails the suite
[ "$rc" = 0 ] || [ "$rc" = 5 ] || exit "$rc"

echo "== processor-dependent tests with the features masked"
# A processor with none of VNNI, bf16 or AMX already ran exactly these paths above (8 minutes saved on AVX2 machines).
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
if grep -qwE 'avx_vnni|avx512_vnni|avx512_bf16|amx_bf16|amx_tile|amx_int8' <<< "$flags"; then
    SHARPI_NO_VNNI=1 SHARPI_BF16=0 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 python -m pytest -q --durations=15 -m cpu_paths
else
    echo "skipped: this processor has no VNNI, bf16 or AMX, so pytest above ran the masked paths"
fi
