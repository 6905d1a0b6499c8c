#!/usr/bin/env bash
# Create .venv and install swarm_opt with its test and demo extras and Opacus (the dp extra, so that its tests run).
# torch==2.13.0 comes first: on these machines it is a CPU build on local disk, and a plain "torch" requirement would
# otherwise pull several GB of CUDA wheels.
# pip's output goes to .venv/setup.log and is shown only if something fails.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
log=.venv/setup.log
pip_install() {
    if ! .venv/bin/python -m pip install --disable-pip-version-check "$@" >>"$log" 2>&1; then
        grep -v "^WARNING: Location" "$log" >&2
        echo "setup failed: pip install $*" >&2
        exit 1
    fi
}
: >"$log"
pip_install --upgrade pip
pip_install "torch==2.13.0"
pip_install -e ".[dev,dp]"
echo "swarm_opt is installed in .venv ($(.venv/bin/python -c 'import swarm_opt; print(swarm_opt.__version__)'))"
