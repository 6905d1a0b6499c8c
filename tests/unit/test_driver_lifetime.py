"""A driver's peers die with it (``swarm_opt.testing.start``, ``PR_SET_PDEATHSIG``): the test suite, the demo and
the benchmarks start every peer this way.

Each peer runs in a session of its own (so that one signal reaches its whole tree), which also takes it out of the
driver's: a driver SIGKILLed (an OOM kill, a pytest run stopped mid-test, which skips its fixtures' teardown) left
its swarm running as orphans, for hours beside later measurements. Here the driver starts a real bootstrap node (the
node, its DHT process and hivemind's ``p2pd``) and is SIGKILLed: the whole session must go."""

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
node = testing.start(["-m", "swarm_opt", "dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], log=Path(sys.argv[1]))
print(node.pid, flush=True)
time.sleep(300)
"""


def _wait(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def _sockets_of_daemon(members) -> list:
    """The unix sockets of the node's P2P link: the daemon's (``-listen=/unix/...p2pd-UID.sock`` on its command
    line) and its client's, the DHT process's (``p2pclient-UID.sock``, the same UID)."""
    for pid in members:
        if Path(f"/proc/{pid}/comm").read_text().strip() == "p2pd":
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            daemon = next(a.split("/unix", 1)[1] for a in args if a.startswith("-listen=/unix"))
            return [daemon, daemon.replace("p2pd-", "p2pclient-")]
    raise AssertionError("no p2pd among the node's processes")


def test_a_peer_dies_whole_with_its_sigkilled_driver(tmp_path):
    """... and its P2P link's unix sockets with it."""
    log = tmp_path / "node.log"
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(log)], stdout=subprocess.PIPE, text=True,
                              env=testing.peer_env())
    members = []
    try:
        node = int(driver.stdout.readline())
        assert testing._stat(node)[3] == node, "the node should lead a session of its own, not share the driver's"
        started = _wait(lambda: "share the addresses" in log.read_text(), 90)
        assert started, f"the node did not start:\n{log.read_text()}"
        members = testing.session_members(node)
        names = sorted(Path(f"/proc/{pid}/comm").read_text().strip() for pid in members)
        assert "p2pd" in names and len(members) >= 3, f"expected the node, its DHT process and p2pd: {names}"
        sockets = [path for path in _sockets_of_daemon(members) if os.path.exists(path)]
        # (the client's exists once a stream handler is added, as averagers add)
        assert sockets and "p2pd-" in sockets[0], sockets
        driver.kill()
        driver.wait(10)
        assert _wait(lambda: not testing.session_members(node), 15), \
            f"outlived their SIGKILLed driver: {testing.session_members(node)}"
        assert not [path for path in sockets if os.path.exists(path)], "left its P2P sockets behind"
    finally:
        driver.kill()
        driver.wait(10)
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
