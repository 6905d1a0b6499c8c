#!/usr/bin/env bash
# The swarm suite under extra load: `bash scripts/test_under_load.sh [RUNS] [BUSY_LOOPS]` (default 5 runs, 3 loops).
# Runs `pytest -m "not extended" tests/swarm` RUNS times while BUSY_LOOPS shell loops spin, one summary line per run
# in $OUT/summary.txt (OUT defaults to /tmp/swarm_under_load), each run's output and peer logs beside it.
set -u
cd "$(dirname "$0")/.."
RUNS=${1:-5}
LOOPS=${2:-3}
OUT=${OUT:-/tmp/swarm_under_load}
mkdir -p "$OUT"
busy=()
for _ in $(seq 1 "$LOOPS"); do ( while :; do :; done ) & busy+=($!); done
trap 'kill "${busy[@]}" 2>/dev/null' EXIT
for run in $(seq 1 "$RUNS"); do
  start=$(date +%s)
  OMP_NUM_THREADS=1 timeout 3000 .venv/bin/python -m pytest -q -p no:cacheprovider --basetemp="$OUT/run$run" \
    -m "not extended" --durations=25 tests/swarm > "$OUT/run$run.out" 2>&1
  rc=$?
  echo "run $run rc=$rc $(( $(date +%s) - start ))s load=$(cut -d' ' -f1-3 /proc/loadavg) $(tail -1 "$OUT/run$run.out")" \
    >> "$OUT/summary.txt"
done
