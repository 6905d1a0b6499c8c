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
# the monitor's browser test drives headless chromium (tests/e2e/test_monitor_web.py); installed quietly where we can
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            chromium; } >>"$log" 2>&1; then
        echo "note: could not install chromium; the monitor's browser test will be skipped (see $log)" >&2
    fi
fi
echo "swarm_opt is installed in .venv ($(.venv/bin/python -c 'import swarm_opt; print(swarm_opt.__version__)'))"
