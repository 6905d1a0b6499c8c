"""A driver's peers die with it: ``swarm_opt.testing.start(..., dies_with_us=True)`` (``PR_SET_PDEATHSIG``).

Each peer runs in a session of its own (so that one signal reaches its whole tree), which also takes it out of the
driver's: a driver SIGKILLed (an OOM kill, a session torn down) left its swarm running as orphans. The soak driver
(``benchmarks/soak.py``) starts its peers this way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm_opt import testing

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

DRIVER = """
import sys, time
from pathlib import Path
from swarm_opt import testing
child = testing.start(["-c", "import time; time.sleep(120)"], log=Path(sys.argv[1]), dies_with_us=sys.argv[2] == "1")
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    stat = testing._stat(pid)
    return stat is not None and stat[0] != "Z"


def _child_of_killed_driver(tmp_path: Path, dies_with_us: bool) -> int:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path / "child.log"), str(int(dies_with_us))],
                              stdout=subprocess.PIPE, text=True, env=testing.peer_env())
    try:
        child = int(driver.stdout.readline())
        assert _alive(child) and testing._stat(child)[3] == child  # in a session of its own, not the driver's
    finally:
        driver.kill()
        driver.wait(10)
    return child


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_a_peer_started_to_die_with_its_driver_dies_when_the_driver_is_sigkilled(tmp_path):
    child = _child_of_killed_driver(tmp_path, dies_with_us=True)
    try:
        assert _gone_within(child, 10), "the driver's peer outlived its SIGKILLed driver"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_without_it_the_peer_of_a_sigkilled_driver_lives_on(tmp_path):
    """The control: what the soak's 2-hour driver left behind when it died."""
    child = _child_of_killed_driver(tmp_path, dies_with_us=False)
    try:
        assert not _gone_within(child, 1), "a peer in a session of its own outlived nothing: the test shows nothing"
    finally:
        os.kill(child, signal.SIGKILL)
