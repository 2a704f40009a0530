#!/usr/bin/env bash
# SharpI against llama.cpp built with CUDA, on the SAME GPU machine, the SAME GGUF file (the random-weight
# Qwen3-30B-A3B geometry, Q4_K_M, 18.55 GB) and the same budgets, in one job, with nvidia-smi's peak memory
# for every run. Every GPU figure in docs/benchmarks.md comes from this script.
#
# On the GPU machine, from the repository root, with .gpucarry (prepare.sh) carried:
#   bash packaging/gpu_sidebyside/driver.sh start [LIST]   # install wheels, start the job detached, return
#   bash packaging/gpu_sidebyside/driver.sh poll SECONDS   # wait for it (at most SECONDS), pack results into $OUT
# LIST: main (the acceptance table of issue #24, ~15 min), quick (one pair of rows), or a file of rows
# "S name args..." (SharpI: `sharpi bench -m F args...`), "R name args..." (SharpI fed random decode tokens, as
# llama-bench's tg is), "L name args..." (llama-bench -m F -p 512 -n 64 -r 2 args...), "X name command..." (any
# command, e.g. a lab; the word {F} stands for the model file), "G geometry" (replace F by a random-weight file of
# another `sharpi synth --geometry`; the rows after it run on that file); leading VAR=value words of an S, R or X row
# are its environment. GEOMETRY (environment of `start`, default qwen3-30b-a3b) names the first file's geometry.
# While /tmp/sbs/hold exists the rows wait (a foreground command of the same call, e.g. CUDA tests, has the GPU).
# The job builds llama-bench (sm_90, ~4–5 min on 16 cores) while it writes the model file, then runs each row
# under `timeout`, sampling nvidia-smi every 250 ms. Results: /tmp/sbs (summary.txt, table.md, logs).
# TESTS="pytest args" (environment of `start`) also runs those CUDA tests while llama.cpp builds (tests.txt;
# TESTS_TIMEOUT seconds, default 480). NOBUILD=1 (environment of `start`): no llama.cpp build, SharpI rows only.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
C=$ROOT/.gpucarry R=/tmp/sbs F=/tmp/F.gguf L=/tmp/llama.cpp B=/tmp/lcpbuild
LLAMA_COMMIT=0c1e57098  # the llama.cpp that llama-cpp-python 0.3.36 vendors

case "${1:-}" in
start)
  if [ -e $R/started ]; then echo "job already started: $(tail -3 $R/progress.txt 2>/dev/null)"; exit 0; fi
  mkdir -p $R && date +%s > $R/started
  LIST=${2:-main} TESTS=${TESTS:-} NOBUILD=${NOBUILD:-} GEOMETRY=${GEOMETRY:-qwen3-30b-a3b} setsid nohup bash "$0" job > $R/job.log 2>&1 < /dev/null &
  echo "job started (pid $!, list ${2:-main})"; exit 0 ;;
poll)
  OUTD=${OUT:-/tmp/out}; mkdir -p "$OUTD"; S=$(date +%s)
  [ -e $R/started ] || { echo "NO JOB on this machine (a fresh machine?): run driver.sh start"; exit 3; }
  while [ ! -e $R/DONE ] && [ $(( $(date +%s) - S )) -lt "${2:-540}" ]; do sleep 5; done
  python3 "$HERE/summ.py" $R > $R/table.md 2>&1
  tar -czf "$OUTD/sbs.tar.gz" -C /tmp sbs 2>/dev/null
  cp $R/summary.txt $R/progress.txt $R/table.md $R/tests.txt "$OUTD/" 2>/dev/null
  [ -e $R/DONE ] && echo DONE || echo "STILL RUNNING after ${2:-540}s"; tail -n 30 $R/progress.txt; exit 0 ;;
job) ;;
*) echo "usage: driver.sh start [LIST] | poll SECONDS" >&2; exit 2 ;;
esac

T0=$(cat $R/started)
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a $R/progress.txt; }
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
cd "$ROOT"
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $C/whl/*.whl \
  > $R/pip.log 2>&1 || log "pip install of the wheels FAILED (see pip.log)"
tar -xzf $C/llama.cpp.tar.gz -C /tmp
[ -d $L ] || mv /tmp/llama.cpp-* $L 2>/dev/null

export CUDACXX=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null)
CUB_SO=$(find /usr/local/cuda*/ /usr/lib/x86_64-linux-gnu "$SP/nvidia" -name 'libcublas.so*' 2>/dev/null | grep -v Lt | head -1)
LBLIB=$(dirname "${CUB_SO:-/x/x}"):/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}  # llama.cpp only
{
  date -u; nvidia-smi; echo "nproc $(nproc)"; lscpu | head -20; free -g
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))'
  echo "sharpi commit $(cat $C/commit.txt 2>/dev/null)"; echo "llama.cpp commit $LLAMA_COMMIT"
} > $R/env.txt 2>&1
log "env: $(nvidia-smi --query-gpu=name --format=csv,noheader) | nproc $(nproc) | sharpi $(cat $C/commit.txt 2>/dev/null)"

build() {
  cmake -S $L -B $B -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_COMMIT=$LLAMA_COMMIT -DLLAMA_BUILD_NUMBER=0 \
    > $R/build.log 2>&1 && LD_LIBRARY_PATH=$LBLIB ninja -C $B -j"$(nproc)" llama-bench >> $R/build.log 2>&1 && touch $R/build.ok
}
synth() {  # [GEOMETRY]: the model file F, random weights in a real model's geometry
  [ -e $F ] || python3 -m engine.cli.main synth --geometry "${1:-$GEOMETRY}" -o $F --fill-random >> $R/synth.log 2>&1
  [ -e $F ] && touch $R/synth.ok && echo "${1:-$GEOMETRY}" > $R/geometry.txt
}
if [ -n "${NOBUILD:-}" ]; then  # SharpI rows only (L rows are skipped): no build competing for the cores
  log "write F (NOBUILD: no llama-bench)"; BPID=
else
  log "build llama-bench + write F (parallel)"
  build & BPID=$!
fi
synth; log "synth: $([ -e $R/synth.ok ] && ls -la $F || echo FAILED)"
if [ -n "${TESTS:-}" ]; then  # on the GPU while llama.cpp builds on the CPUs; F serves the budget test
  log "CUDA tests: pytest $TESTS"
  SHARPI_TEST_30B_GGUF=$F timeout ${TESTS_TIMEOUT:-480} python3 -m pytest -q -p no:cacheprovider $TESTS > $R/tests.txt 2>&1
  log "tests: $(tail -1 $R/tests.txt)"
fi
[ -z "$BPID" ] || { wait $BPID; log "build: $([ -e $R/build.ok ] && echo ok || { echo FAILED; grep -m5 -iE 'error' $R/build.log; })"; }

vram_on() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 > $R/$1.vram 2>&1 & VP=$!; }
vram_off() { kill $VP 2>/dev/null; wait $VP 2>/dev/null; echo "$1 peak MiB: $(grep -E '^ *[0-9]+ *$' $R/$1.vram | sort -n | tail -1)" >> $R/summary.txt; }
row() {  # KIND NAME ARGS...
  local kind=$1 n=$2; shift 2
  if [ "$kind" = G ]; then  # another model file: the old one goes (the box's disk holds one)
    rm -f $F $R/synth.ok; log "synth $n"; synth "$n"
    log "synth: $([ -e $R/synth.ok ] && ls -la $F || echo FAILED)"; echo "=== G $n" >> $R/summary.txt; return
  fi
  [ -e $R/synth.ok ] || { log "skip $n (no model)"; return; }
  local cmd to=480 envs=()
  while [ $# -gt 0 ] && [[ $1 =~ ^[A-Z_][A-Z0-9_]*= ]]; do envs+=("$1"); shift; done  # "S name VAR=1 args": env
  case $kind in
    L) [ -e $R/build.ok ] || { log "skip $n (no llama-bench)"; return; }
       cmd=(env LD_LIBRARY_PATH=$LBLIB $B/bin/llama-bench -m $F -p 512 -n 64 -r 2 "$@"); to=300 ;;
    S) cmd=(env "${envs[@]}" python3 -m engine.cli.main bench -m $F --prompt 512 --gen 64 --repeat 2 --device cuda --json "$@") ;;
    R) cmd=(env "${envs[@]}" python3 $HERE/randtok_bench.py bench -m $F --prompt 512 --gen 64 --repeat 2 --device cuda --json "$@") ;;
    X) local words=("$@"); cmd=(env "${envs[@]}" "${words[@]//\{F\}/$F}"); to=540 ;;
    *) log "skip $n (unknown row kind $kind)"; return ;;
  esac
  log "start $n: ${cmd[*]}"; echo "=== $kind $n: ${cmd[*]}" >> $R/summary.txt
  vram_on $n; timeout $to "${cmd[@]}" > $R/$n.out 2> $R/$n.err; local rc=$?; vram_off $n
  [ $rc = 0 ] || { echo "$n rc=$rc"; tail -5 $R/$n.err; } >> $R/summary.txt
  log "end $n rc=$rc"
}
case "${LIST:-main}" in
main)
  LIST_ROWS=$(cat <<'ROWS'
S S_auto12 --vram 12GiB
R R_auto12 --vram 12GiB
L L_ncmoe18 -ngl 99 --n-cpu-moe 18 -t 16
L L_ncmoe19 -ngl 99 --n-cpu-moe 19 -t 16
L L_ncmoe20 -ngl 99 --n-cpu-moe 20 -t 16
S S_cache12 --vram 12GiB --moe cache
S S_cpu --vram 12GiB --moe cpu
L L_cpumoe48 -ngl 99 --n-cpu-moe 48 -t 16
S S_auto8 --vram 8GiB
S S_resident --vram 30GiB --moe resident
L L_gpu -ngl 99 -t 16
ROWS
) ;;
quick)
  LIST_ROWS=$'S S_auto12 --vram 12GiB\nL L_ncmoe19 -ngl 99 --n-cpu-moe 19 -t 16' ;;
*) LIST_ROWS=$(cat "$LIST") ;;
esac
[ -e $R/hold ] && log "rows wait for $R/hold to go"
while [ -e $R/hold ]; do sleep 2; done
while read -r kind name rest; do
  [ -n "$kind" ] && [ "${kind:0:1}" != "#" ] && row "$kind" "$name" $rest
done <<< "$LIST_ROWS"
log "ALL DONE"; touch $R/DONE
