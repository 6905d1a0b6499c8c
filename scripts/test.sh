#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: unit tests, real loopback swarms, CLI and demo end-to-end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
set +e
# the extended swarm scenarios run with `bash scripts/test_extended.sh` (CI runs both: .ci/run). Two workers (-n 2,
# pytest-xdist): the suite runs in about two thirds of the time, and every swarm test runs beside another test's
# peers, as on a user's busy machine (its invariants must hold there too)
.venv/bin/python -m pytest -q -m "not extended" -n 2 --durations=15 "$@"
status=$?
set -e
# pytest's exit code 5 means "no tests collected": never green
if [ "$status" -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit "$status"
