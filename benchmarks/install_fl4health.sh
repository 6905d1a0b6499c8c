#!/usr/bin/env bash
# Install FL4Health 0.4.2 (and Flower 1.18) into .venv for benchmarks/vs_fl4health.py, without touching what
# swarm_opt runs on. FL4Health 0.4.2 declares Python < 3.11, torch == 2.6.0 and numpy < 2; this project's .venv has
# Python 3.11, torch 2.13 (CPU) and numpy 2, and a plain `pip install fl4health` refuses the Python version (and would
# pull torch 2.6 with its CUDA wheels). So FL4Health, Flower and dp-accounting go in without their dependencies, then
# only the modules that the server, client and accountant code paths the benchmark uses import, with torch, numpy,
# protobuf and grpcio held at the versions already installed. wandb is needed only because fl4health.reporting imports
# it at module level; the releases before 0.2x cannot load with protobuf 7 (hivemind's), hence 0.31.
set -euo pipefail
cd "$(dirname "$0")/.."
pip=".venv/bin/python -m pip"
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
.venv/bin/python -m pip freeze | grep -iE "^(torch|numpy|protobuf|grpcio|grpcio-tools)==" >"$constraints"
$pip install --disable-pip-version-check --no-deps --ignore-requires-python \
    "fl4health==0.4.2" "flwr>=1.18,<1.19" "dp-accounting>=0.4.3,<0.5"
$pip install --disable-pip-version-check -c "$constraints" \
    "typer>=0.12.5,<0.13" iterators tomli tomli-w pathspec pycryptodome rich requests absl-py "dm-tree>=0.1.9,<0.2" \
    platformdirs "wandb==0.31.0"
.venv/bin/python -c "import fl4health.servers.scaffold_server, fl4health.clients.scaffold_client, \
fl4health.clients.fed_prox_client, fl4health.servers.adaptive_constraint_servers.fedprox_server, torch; \
print('fl4health imports; torch', torch.__version__)"
