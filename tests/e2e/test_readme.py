"""The README's strategy examples run as printed (a one-peer swarm per strategy)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_strategy_examples_in_the_readme_run(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(b for b in blocks if "def train(strategy" in b)
    script = tmp_path / "example.py"
    script.write_text(example)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=280,
                          cwd=README.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("GradientAveraging", "LocalUpdates", "FedProx", "Scaffold", "DiLoCo"):
        assert re.search(rf"^{name} reached epoch 5$", done.stdout, flags=re.M), done.stdout
    assert "Traceback" not in done.stderr and "WARNING" not in done.stderr, done.stderr
