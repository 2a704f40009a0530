#!/usr/bin/env bash
# A/B on one lent GPU box: two SharpI trees (a before and an after commit) on the same random-weight
# Qwen3-30B-A3B-geometry Q4_K_M file, the same budgets, alternating runs, with nvidia-smi's peak
# memory per run; and the after tree's CUDA tests. Used for "no slower than before" checks.
#
# Here (repository root): put A.tar.gz and B.tar.gz (git archive <commit> | gzip), A.txt / B.txt (the
# commits) and whl/ (gguf, platformdirs wheels for the box's Python) into an ignored folder beside
# this script's copy, e.g. .gpucarry/, and carry it. On the box:
#   bash .gpucarry/driver.sh start     # launches the job detached (setsid) and returns
#   bash .gpucarry/poll.sh SECONDS     # waits for it, packs /tmp/ab into $OUT; call again until DONE
set -uo pipefail
C=$(cd "$(dirname "$0")" && pwd)
R=/tmp/ab F=/tmp/F.gguf
case "${1:-}" in
start)
  [ -e $R/started ] && { echo "already started"; tail -3 $R/progress.txt; exit 0; }
  mkdir -p $R; date +%s > $R/started
  setsid nohup bash "$C/driver.sh" job > $R/job.log 2>&1 < /dev/null &
  echo "job started"; exit 0 ;;
job) ;;
*) echo "usage: driver.sh start" >&2; exit 2 ;;
esac
T0=$(cat $R/started)
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a $R/progress.txt; }
mkdir -p /tmp/site /tmp/A /tmp/B
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $C/whl/*.whl > $R/pip.log 2>&1
tar -xzf $C/A.tar.gz -C /tmp/A; tar -xzf $C/B.tar.gz -C /tmp/B
{ date -u; nvidia-smi; lscpu | head -20; free -g
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))'
  echo "A $(cat $C/A.txt)  B $(cat $C/B.txt)"; } > $R/env.txt 2>&1
log "env: $(nvidia-smi --query-gpu=name --format=csv,noheader) nproc $(nproc); A $(cat $C/A.txt) B $(cat $C/B.txt)"

log "synth + CUDA tests of B (parallel; SKIP_TESTS=1 in $C/env.sh skips them)"
[ -e $C/env.sh ] && . $C/env.sh
( cd /tmp/B && PYTHONPATH=/tmp/site:/tmp/B python3 -m engine.cli.main synth --geometry qwen3-30b-a3b -o $F --fill-random > $R/synth.log 2>&1 && touch $R/synth.ok ) &
SP=$!
[ -n "${SKIP_TESTS:-}" ] || ( cd /tmp/B && PYTHONPATH=/tmp/site:/tmp/B timeout 900 python3 -m pytest -q -p no:cacheprovider -m cuda tests > $R/tests_cuda.log 2>&1; echo "rc $?" >> $R/tests_cuda.log ) &
TP=$!
wait $SP; log "synth: $([ -e $R/synth.ok ] && ls -la $F || tail -3 $R/synth.log)"
wait; [ -n "${SKIP_TESTS:-}" ] || log "cuda tests: $(grep -E 'passed|failed|error' $R/tests_cuda.log | tail -1)"

vram_on() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 > $R/$1.vram 2>&1 & VP=$!; }
vram_off() { kill $VP 2>/dev/null; wait $VP 2>/dev/null; echo "$(grep -E '^ *[0-9]+ *$' $R/$1.vram | sort -n | tail -1)"; }
run() {  # name tree[+SHARPI_BF16 value] args...
  local n=$1 t=${2%%+*} bf=""; [ "$2" != "${2#*+}" ] && bf=${2#*+}; shift 2
  [ -e $R/synth.ok ] || { log "skip $n"; return; }
  vram_on $n
  ( cd /tmp/$t && env ${bf:+SHARPI_BF16=$bf} PYTHONPATH=/tmp/site:/tmp/$t timeout 420 python3 -m engine.cli.main bench -m $F "$@" --json > $R/$n.json 2> $R/$n.err )
  local rc=$? peak=$(vram_off $n)
  local s=$(python3 -c "import json; d=json.load(open('$R/$n.json')); print('prompt', round(d['prompt_tok_s'], 1), d.get('prompt_tok_s_all'), 'decode', round(d['decode_tok_s'], 2), d.get('decode_tok_s_all'), 'hit', d.get('hit_rate'), '|', d.get('placement'))" 2>&1 | tail -1)
  echo "$n rc=$rc peak_MiB=$peak $s" >> $R/summary.txt
  log "$n rc=$rc peak $peak MiB"
}
census() {  # name tree step_census-args...
  local n=$1 t=$2; shift 2
  ( cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 420 python3 $C/step_census.py $F "$@" > $R/$n.txt 2>&1 )
  log "$n rc=$?: $(grep -E 'a step' $R/$n.txt | tr '\n' ' ')"
}
SH="--prompt 512 --gen 64 --repeat 2 --device cuda"
if [ -e $C/runs.txt ]; then  # one run a line: name tree bench-args... (a name census*: step_census.py args)
  while read -r n t args; do
    case "$n" in "") ;; census*) census $n $t $args ;; *) run $n $t $args ;; esac
  done < $C/runs.txt
else
  for cfg in cpu cache; do
    for t in A B; do run ${t}_$cfg $t $SH --vram 12GiB --moe $cfg; done
  done
  for t in A B; do run ${t}_resident $t $SH --vram 30GiB --moe resident; done
fi
log "ALL DONE"; touch $R/DONE
