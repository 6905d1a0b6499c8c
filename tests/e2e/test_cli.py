"""The ``swarm-opt`` command line, run the way a user runs it: ``python -m swarm_opt`` in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import swarm_opt
from swarm_opt.cli.commands import SUBCOMMANDS, main

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "swarm_opt", *args], capture_output=True, text=True, timeout=90,
                          cwd=REPO, env=env)


def test_version_prints_name_and_version():
    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"swarm-opt {swarm_opt.__version__}\n"
    assert result.stderr == ""


def test_help_lists_the_planned_commands():
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: swarm-opt")
    for name in ("dht", "train", "monitor"):
        assert f"    {name} " in result.stdout, result.stdout
    assert result.stderr == ""


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["train", "--help"], ["dht", "--help"],
                                  ["monitor", "--help"]])
def test_help_does_not_import_torch_or_hivemind(args):
    """Asking the command line for help must be instant: torch and hivemind are imported only by the commands."""
    code = ("import sys\nfrom swarm_opt.cli.commands import main\nstatus = main(sys.argv[1:])\n"
            "heavy = sorted(m for m in ('torch', 'hivemind', 'numpy') if m in sys.modules)\n"
            "print('HEAVY:', ','.join(heavy), file=sys.stderr)\nsys.exit(status)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=90,
                            cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(("usage: swarm-opt", "swarm-opt ")), result.stdout
    assert result.stderr == "HEAVY: \n", result.stderr


@pytest.mark.parametrize("args, fragment", [
    ([], "a command is required"),
    (["bogus"], "invalid choice: 'bogus'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_input_is_one_line_without_traceback(args, fragment):
    result = run_cli(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert fragment in result.stderr and "--help" in result.stderr
    assert "Traceback" not in result.stderr


# in-process: the same contract through main(argv), which returns the status instead of exiting


def test_main_returns_status_codes(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"swarm-opt {swarm_opt.__version__}\n"
    assert main(["--nope"]) == 2
    assert "unrecognized arguments" in capsys.readouterr().err
    for name in SUBCOMMANDS:
        assert main([name, "--help"]) == 0
        assert capsys.readouterr().out.startswith(f"usage: swarm-opt {name}")
