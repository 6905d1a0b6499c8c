#!/usr/bin/env bash
# Create .venv and install swarm_opt with its test and demo extras. torch==2.13.0 comes first: on these machines it
# is a CPU build on local disk, and a plain "torch" requirement would otherwise pull several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
