#!/usr/bin/env bash
# The long swarm scenarios (tests marked `extended`: Lightning and Trainer resumes, the gloo lane's faults, robust
# aggregation per attack, partitions, a disk that fills up, a few minutes of soak under churn, 24 peers in groups,
# ...), which `bash scripts/test.sh` skips to stay within 20 minutes; extra arguments go to pytest. One after another
# by default; SWARM_OPT_TEST_WORKERS=3 runs them on three pytest-xdist workers (about 27 minutes on 2 cores, as CI
# runs them after the default suite: .ci/run, docs/long-runs.md#ci).
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
