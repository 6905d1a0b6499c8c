"""``swarm-opt doctor`` across hosts (network namespaces on a bridge, ``tests/hosts.py``): a host the swarm can reach,
a host that accepts no connections from the others (it gets the client-mode advice), and bootstrap addresses that
fail for different reasons (each named, with why). Skipped, with the reason, where namespaces cannot be created."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.conftest import cli_env
from tests.e2e.test_netns import Host
from tests.hosts import Hosts, namespaces_unavailable


@pytest.fixture
def hosts():
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    made = Hosts(3)
    try:
        yield made
    finally:
        made.close()


def doctor(hosts: Hosts, i: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*hosts.prefix(i), sys.executable, "-m", "swarm_opt", "doctor", "--timeout", "3", *args],
                          capture_output=True, text=True, timeout=120, env=cli_env(), start_new_session=True)


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_doctor_tells_reachable_hosts_from_unreachable_ones_and_names_failing_bootstraps(hosts, tmp_path):
    node = Host(hosts, 0, "dht", ["dht", "--host-maddrs", f"/ip4/{hosts.address(0)}/tcp/31337"], tmp_path, cli_env())
    try:
        bootstrap = node.wait_for(r"^/ip4/\S+/p2p/\S+$", 60).group(0)
        peer_id = bootstrap.rsplit("/", 1)[1]

        # a host whose port others can dial: every check passes
        fine = doctor(hosts, 1, "--initial-peers", bootstrap, "--host-maddrs", f"/ip4/{hosts.address(1)}/tcp/0")
        assert fine.returncode == 0, fine.stdout + fine.stderr
        assert "ok    reachability: a peer of the swarm dialed this machine" in fine.stdout, fine.stdout
        assert "ok    clock:" in fine.stdout and "Traceback" not in fine.stderr

        # a host that accepts no connection from the others (it listens only inside itself): client-mode advice
        closed = doctor(hosts, 2, "--initial-peers", bootstrap, "--host-maddrs", "/ip4/127.0.0.1/tcp/0")
        assert closed.returncode == 1, closed.stdout + closed.stderr
        line = next(x for x in closed.stdout.splitlines() if "reachability" in x)
        assert line.startswith("FAIL  reachability: the swarm cannot connect to this machine at /ip4/127.0.0.1/tcp/")
        assert "--client-mode" in line and "--announce-maddrs /ip4/" in line, line
        assert "client mode: this peer only dials out" in doctor(hosts, 2, "--initial-peers", bootstrap,
                                                                   "--client-mode").stdout

        # bootstraps that fail: nothing listens on the port; no host at the address
        refused = f"/ip4/{hosts.address(0)}/tcp/31338/p2p/{peer_id}"
        absent = f"/ip4/{hosts.address(0).rsplit('.', 1)[0]}.200/tcp/31337/p2p/{peer_id}"
        broken = doctor(hosts, 1, "--initial-peers", refused, absent)
        assert broken.returncode == 1 and "Traceback" not in broken.stderr, broken.stdout + broken.stderr
        lines = broken.stdout.splitlines()
        assert any(x.startswith(f"FAIL  initial peer {refused}: unreachable: connection refused: nothing listens on")
                   for x in lines), broken.stdout
        assert any(x.startswith(f"FAIL  initial peer {absent}: unreachable: ") and
                   ("no answer" in x or "No route to host" in x) for x in lines), broken.stdout
        assert lines[-1].startswith("FAIL  no initial peer is reachable from this machine"), broken.stdout
    finally:
        node.proc.terminate()
        node.proc.wait(30)
