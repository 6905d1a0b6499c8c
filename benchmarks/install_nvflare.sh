#!/usr/bin/env bash
# Install NVIDIA FLARE 2.9.0 into .venv for benchmarks/vs_nvflare.py, without touching what swarm_opt runs on.
# NVFlare 2.9.0's core requirements (Flask, gunicorn, docker, pyhocon, SQLAlchemy, ...) do not clash with this
# project's: it declares Python >= 3.10 and leaves torch and numpy unpinned, so it goes into the project's own venv.
# Every package already installed is held at its installed version (a constraints file from `pip freeze`), so the
# install only adds packages; nothing already there is upgraded or downgraded. Its Lightning client API
# (nvflare.client.lightning) imports `pytorch_lightning`, which the project's [lightning] extra already installs
# (pytorch-lightning beside lightning). No NVFlare extra is needed: the simulator, the Lightning client API, the
# PyTorch recipes (FedAvgRecipe, ScaffoldRecipe) are in the core package.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
$python -m pip freeze --exclude-editable | grep -v " @ " >"$constraints"
$python -m pip install --disable-pip-version-check -c "$constraints" "nvflare==2.9.0"
$python -c "import nvflare, nvflare.client.lightning, nvflare.app_opt.pt.recipes.scaffold, \
nvflare.app_opt.pt.recipes.fedavg, nvflare.recipe.sim_env, pytorch_lightning, torch, numpy; \
print('nvflare', nvflare.__version__, '| pytorch_lightning', pytorch_lightning.__version__, '| torch', \
torch.__version__, '| numpy', numpy.__version__)"
