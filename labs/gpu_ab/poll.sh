#!/usr/bin/env bash
# Wait for driver.sh's job at most $1 seconds, then copy its results into $OUT (safe to repeat).
R=/tmp/ab LIMIT=${1:-540}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -e $R/started ] || { echo "NO JOB (fresh machine?)"; exit 3; }
S=$(date +%s)
while [ ! -e $R/DONE ] && [ $(( $(date +%s) - S )) -lt "$LIMIT" ]; do sleep 5; done
tar -czf "$OUT/ab.tar.gz" -C /tmp ab 2>/dev/null
cp $R/summary.txt $R/progress.txt "$OUT/" 2>/dev/null
[ -e $R/DONE ] && echo DONE || echo "STILL RUNNING"
tail -n 30 $R/progress.txt; cat $R/summary.txt 2>/dev/null
