#!/usr/bin/env bash
# The long swarm scenarios (tests marked `extended`: Lightning and Trainer resumes, the gloo lane's faults, robust
# aggregation per attack, partitions, a disk that fills up, a few minutes of soak under churn, 24 peers in groups,
# ...), which `bash scripts/test.sh` skips to stay within 20 minutes; extra arguments go to pytest. One after another
# by default; SWARM_OPT_TEST_WORKERS=3 runs them on three pytest-xdist workers, as CI does after the default suite
# (.ci/run, docs/long-runs.md#ci). Scenarios marked `solo` (a swarm that alone fills a 2-core machine) run last, by
# themselves: beside them, every other swarm starves.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
export OMP_NUM_THREADS=1
.venv/bin/python -m pytest -q --durations=15 -m "extended and not solo" -n "${SWARM_OPT_TEST_WORKERS:-0}" "$@"
shared=$?
.venv/bin/python -m pytest -q --durations=5 -m "extended and solo" "$@"
solo=$?
# pytest's exit code 5 means "no tests were collected": fine for one phase (e.g. -k picked none of it), never both
if [ "$shared" -eq 5 ] && [ "$solo" -eq 5 ]; then echo "no extended tests were collected" >&2; exit 1; fi
for status in "$shared" "$solo"; do
    if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then exit "$status"; fi
done
exit 0
