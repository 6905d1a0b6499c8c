#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: unit tests, real loopback swarms, CLI and demo end-to-end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
set +e
# the extended swarm scenarios run with `bash scripts/test_extended.sh` (CI runs both: .ci/run). Three workers (-n 3,
# pytest-xdist) on 2 cores: the swarm tests wait on rounds and deadlines as much as they compute (20:02 against
# 24:39 with two workers on a slower 2-core machine, docs/long-runs.md#ci), and every swarm test runs beside other
# tests' peers, as on a user's busy machine (its invariants must hold there too)
.venv/bin/python -m pytest -q -m "not extended" -n 3 --durations=15 "$@"
status=$?
set -e
# pytest's exit code 5 means "no tests collected": never green
if [ "$status" -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit "$status"
