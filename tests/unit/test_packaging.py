"""What the package promises about itself holds for its code."""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _oldest_python() -> str:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    match = re.fullmatch(r">=\s*(3\.\d+)", config["options"]["python_requires"].strip())
    assert match, "python_requires should read '>=3.N'"
    return match.group(1)


def test_the_code_needs_no_newer_python_than_setup_cfg_requires():
    # vermin reads which Python each construct and standard-library member needs (contextlib.aclosing: 3.10);
    # tomllib is imported only where present, with an error naming the alternative
    found = subprocess.run(
        [sys.executable, "-c", "import sys; from vermin import main; sys.exit(main())", "-q", "--no-tips",
         "--violations", f"-t={_oldest_python()}-", "--exclude", "tomllib", str(ROOT / "swarm_opt")],
        capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stdout + found.stderr


def test_ruff_targets_the_oldest_python_setup_cfg_requires():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'target-version = "py{_oldest_python().replace(".", "")}"' in pyproject
