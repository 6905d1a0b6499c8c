#!/usr/bin/env bash
# The long swarm scenarios (tests marked `extended`: Lightning and Trainer resumes, the gloo lane's faults, robust
# aggregation per attack, partitions, a disk that fills up, a few minutes of soak under churn, 24 peers in groups,
# ...), which `bash scripts/test.sh` skips to stay within 20 minutes; extra arguments go to pytest. One after another
# by default: 55 minutes on 2 cores before the partition swarms were merged (8 fewer expected, not measured).
# SWARM_OPT_TEST_WORKERS=3 runs them on three pytest-xdist workers: 25 to 31 minutes on 2 cores, but there 1 to 5 of
# 85 failed under the load (the last runs: a replay that needs five epochs without a catch-up, a soak newcomer slow
# to leave): use it on a machine with more cores (docs/long-runs.md#ci).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
set +e
.venv/bin/python -m pytest -q -m extended -n "${SWARM_OPT_TEST_WORKERS:-0}" --durations=15 "$@"
status=$?
set -e
# pytest's exit code 5 means "no tests were collected": never green
if [ "$status" -eq 5 ]; then echo "no extended tests were collected" >&2; exit 1; fi
exit "$status"
