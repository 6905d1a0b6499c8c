#!/usr/bin/env bash
# The long swarm scenarios (tests marked `extended`: Lightning and Trainer resumes, the gloo lane's faults, robust
# aggregation per attack, partitions, a disk that fills up, a few minutes of soak under churn, ...), which
# `bash scripts/test.sh` skips to stay within 20 minutes. CI runs this after it (.ci/run); extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
set +e
.venv/bin/python -m pytest -q -m extended --durations=15 "$@"
status=$?
set -e
# pytest's exit code 5 means "no tests were collected": never green
if [ "$status" -eq 5 ]; then echo "no extended tests were collected" >&2; exit 1; fi
exit "$status"
